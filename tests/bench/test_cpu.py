"""bench.cpu's figures: medians over rounds and the table built from them."""

from bench.cpu import median_passes, table


def _pass(tok_s, ttft, tpot, failed=0):
    return {"output_tok_s": tok_s, "ttft_ms": ttft, "tpot_ms": tpot, "failed": failed,
            "completed": 8 - failed}  # fmt: skip


def test_rounds_merge_to_the_median_of_each_figure_and_the_sum_of_failures():
    rounds = [
        {1: _pass(40.0, 250.0, 25.0), 8: _pass(150.0, 400.0, 50.0)},
        {1: _pass(30.0, 300.0, 20.0, failed=1), 8: _pass(120.0, 380.0, 60.0)},
        {1: _pass(45.0, 260.0, 40.0), 8: _pass(160.0, 500.0, 55.0)},
    ]
    merged = median_passes(rounds)
    assert merged[1] == {"output_tok_s": 40.0, "ttft_ms": 260.0, "tpot_ms": 25.0,
                         "failed": 1, "completed": 23}  # fmt: skip
    assert merged[8]["output_tok_s"] == 150.0 and merged[8]["tpot_ms"] == 55.0


def test_the_table_reports_one_stream_from_the_median_tpot_against_the_roofline():
    results = {
        "kvserve": {"weights": "fp32", "passes": {1: _pass(0, 250.0, 20.0), 8: _pass(150.0, 0, 0)}},
        "peer": {"weights": "fp32", "error": "did not start"},
    }
    text = table(results, bandwidth=25e9, step_bytes={"fp32": 500_000_000}, conc=[1, 8])
    rows = text.splitlines()
    assert rows[0].startswith("| server (weights) | 1 stream decode tok/s | % of roofline")
    # 1000 / 20 ms = 50 tok/s against a roofline of 25e9 / 5e8 = 50 tok/s.
    assert rows[2] == "| kvserve (fp32) | 50.0 | 100.0 | 250.0 | 150.0 |"
    assert rows[3].startswith("| peer | did not start |")
