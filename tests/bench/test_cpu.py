"""bench.cpu's figures: medians over rounds and the table built from them."""

import pytest

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
        "kvserve": {
            "weights": "fp32",
            "passes": {
                1: _pass(0, 250.0, 20.0),
                8: _pass(150.0, 0, 0),
                "start": {"startup_s": 4.25, "rss_mb": 612.4},
            },
        },
        "peer": {"weights": "fp32", "error": "did not start"},
    }
    text = table(results, bandwidth=25e9, step_bytes={"fp32": 500_000_000}, conc=[1, 8])
    rows = text.splitlines()
    assert rows[0].startswith("| server (weights) | 1 stream decode tok/s | % of roofline")
    # 1000 / 20 ms = 50 tok/s against a roofline of 25e9 / 5e8 = 50 tok/s.
    assert rows[2] == "| kvserve (fp32) | 50.0 | 100.0 | 250.0 | 150.0 | 4.2 | 612 |"
    assert rows[3].startswith("| peer | did not start |")


def _record(ttft_s, tpot_s, tokens=11, success=True):
    from bench.loadtest import RequestRecord

    e2e = ttft_s + tpot_s * (tokens - 1)
    return RequestRecord(index=0, scheduled_s=0.0, start_s=0.0, end_s=e2e, success=success,
                         ttft_s=ttft_s, output_tokens=tokens)  # fmt: skip


def test_paired_summary_takes_medians_and_per_prompt_ratios_to_the_first_server():
    from bench.cpu import paired_summary

    # The peer is 1.5x, 2x, 1x kvserve's TPOT on the three prompts (median 1.5) while its own
    # median TPOT is 30 ms against kvserve's 20: the pairs, not the medians, give the ratio.
    records = {
        "kvserve": [_record(0.2, 0.020), _record(0.3, 0.010), _record(0.25, 0.040)],
        "peer": [_record(0.1, 0.030), _record(0.2, 0.020), _record(0.3, 0.040)],
        "flaky": [_record(0.1, 0.020), _record(0.1, 0.020, success=False), _record(0.1, 0.060)],
    }
    s = paired_summary(records, "kvserve")
    assert s["kvserve"]["tpot_ms"] == pytest.approx(20.0) and s["kvserve"]["ttft_ms"] == 250.0
    assert s["kvserve"]["tpot_vs_first"] == pytest.approx(1.0)
    assert s["peer"]["tpot_ms"] == pytest.approx(30.0)
    assert s["peer"]["tpot_vs_first"] == pytest.approx(1.5)
    # A failed request counts as failed and leaves its prompt out of the pairs.
    assert s["flaky"]["failed"] == 1
    assert s["flaky"]["tpot_vs_first"] == pytest.approx((1.0 + 1.5) / 2)


def test_the_paired_table_reports_tok_s_roofline_and_ratio():
    from bench.cpu import paired_table

    summary = {
        "kvserve": {"tpot_ms": 20.0, "ttft_ms": 200.0, "failed": 0, "tpot_vs_first": 1.0},
        "peer": {"tpot_ms": 25.0, "ttft_ms": 180.0, "failed": 2, "tpot_vs_first": 1.25},
    }
    text = paired_table(summary, {"kvserve": "fp32", "peer": "fp32"}, 25e9,
                        {"fp32": 500_000_000}, "kvserve")  # fmt: skip
    rows = text.splitlines()
    assert rows[2] == "| kvserve (fp32) | 50.0 | 100.0 | 200.0 | 1.000 | 0 |"
    assert rows[3] == "| peer (fp32) | 40.0 | 80.0 | 180.0 | 1.250 | 2 |"


def test_waiting_for_a_quiet_box_is_bounded():
    import asyncio
    import time

    from bench.cpu import quiet

    start = time.monotonic()
    asyncio.run(quiet(window_s=0.01, busy=-1.0, limit_s=0.1))  # never quiet enough: the limit
    assert 0.1 <= time.monotonic() - start < 2.0


def test_a_baseline_checkout_is_served_by_the_same_command_from_its_own_sources(tmp_path):
    from bench.cpu import BASELINE, Server, servers

    plain = servers(tmp_path, 8100, ["--seed", "1"])
    assert isinstance(plain[BASELINE], str)  # says why it cannot run
    found = servers(tmp_path, 8100, ["--seed", "1"], baseline="/src/old")
    ours, old = found["kvserve"], found[BASELINE]
    assert isinstance(old, Server) and old.command == ours.command
    assert old.command[-2:] == ["--seed", "1"] and "8100" in old.command
    # Its own sources first on the path, and its C++ kernels built apart from ours.
    assert old.env == {
        "PYTHONPATH": "/src/old",
        "TORCH_EXTENSIONS_DIR": "/src/old/.torch_extensions",
    }
    assert ours.env == {}
