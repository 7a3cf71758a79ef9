"""bench.spec's figures: medians over rounds, the table, the ratios against the targets."""

from __future__ import annotations

from bench.spec import merge, ratios, table

W = ("code rewrite, 1 stream", "questions, 1 stream", "questions, 8 concurrent")


def passes(decode: float, total: float, accepted: float | None) -> dict:
    return {
        w: dict(decode_tok_s=decode, total_tok_s=total, tokens=[10], accepted_pct=accepted)
        for w in W
    }


def test_rounds_merge_to_medians_and_ratios_say_met_or_not():
    results = {
        "kvserve": merge([passes(10, 30, None), passes(12, 32, None), passes(11, 31, None)]),
        "kvserve draft": merge([passes(19, 29, 90), passes(21, 30, 92), passes(20, 31, 94)]),
        "kvserve ngram": merge([passes(18, 33, 70)]),
        "llama.cpp draft": {"error": "did not start"},
    }
    assert results["kvserve"][W[0]]["decode_tok_s"] == 11
    assert results["kvserve draft"][W[0]]["accepted_pct"] == 92
    assert results["kvserve"][W[0]]["accepted_pct"] is None
    lines = ratios(results)
    draft = next(x for x in lines if x.startswith("| kvserve draft / kvserve, code"))
    assert "1.82 (not met)" in draft  # 20 / 11 against 2.0
    ngram = next(x for x in lines if x.startswith("| kvserve ngram / kvserve, code"))
    assert "1.64 (met)" in ngram  # 18 / 11 against 1.5
    peer = next(x for x in lines if "llama.cpp draft" in x)
    assert "| – |" in peer  # the peer did not run: no ratio
    text = table(results)
    assert "| llama.cpp draft | did not start |" in text
    assert "| kvserve draft | 20.0 | 92 |" in text
