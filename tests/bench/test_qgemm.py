"""bench.qgemm: every format and row count timed against the peak of the build's multiply."""

import json

import pytest

from bench import qgemm
from kernels import cpu

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")


def test_every_format_and_row_count_is_reported_beside_each_builds_peak(monkeypatch, tmp_path):
    monkeypatch.setattr(qgemm, "box_bandwidth", lambda: 1e10)
    out = str(tmp_path / "q")
    argv = ["--formats", "q4_k", "q8_0", "--rows", "1", "9", "--k", "512", "--n", "64"]
    qgemm.main([*argv, "--threads", "1", "--repeats", "1", "--out", out])
    report = json.loads((tmp_path / "q.json").read_text())
    assert set(report["peak_gmacs"]) == set(cpu.isas())
    # Rates, not timings held to a target: a core does billions of byte products a second.
    assert all(0.1 < p < 10_000 for p in report["peak_gmacs"].values())
    got = [(r["format"], r["layout"], r["rows"]) for r in report["results"]]
    assert got == [
        (fmt, layout, rows)
        for fmt in ("q4_k", "q8_0")
        for layout in ("packed", "file")
        for rows in (1, 9)
    ]
    assert all(r["of_peak"] > 0 and r["gmacs"] > 0 for r in report["results"])
    table = (tmp_path / "q.md").read_text()
    assert "| q8_0 | file | 9 |" in table and "| q4_k | packed | 1 |" in table
    assert report["box"] in table
