"""bench.gpu, the one command for a lent GPU, and bench.quant_speed, one of its stages: what
runs without a device (the stage runner, the served checkpoint's tokenizer, the smoke path)."""

from __future__ import annotations

import sys

import pytest

from bench import gpu, quant_speed
from models.tokenizer import Tokenizer


def test_stages_run_in_turn_under_their_deadlines(tmp_path, monkeypatch):
    """A stage that passes, one that runs past its deadline and is stopped, and one the budget
    leaves no time for: each recorded in the summary, whose table comes last."""
    py = sys.executable
    commands = {
        "A": ("quick", [py, "-c", "print('all good')"]),
        "B": ("slow", [py, "-c", "import time; print('begun', flush=True); time.sleep(60)"]),
        "C": ("late", [py, "-c", "print('never')"]),
    }
    monkeypatch.setattr(gpu, "stage_commands", lambda out: commands)
    monkeypatch.setattr(gpu, "DEADLINES", {"A": 30, "B": 2, "C": 30})
    monkeypatch.setattr(gpu, "MIN_STAGE_S", 2)
    results = gpu.run_stages(tmp_path, ["A", "B", "C"], budget=3.5)
    assert [r["rc"] for r in results] == [0, "timed out after 2 s", "skipped: budget spent"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "all good" in summary and "begun" in (tmp_path / "B.log").read_text()
    assert summary.rstrip().endswith("| C | late | skipped: budget spent | 0 |")
    assert "torch" in summary.splitlines()[1]


def test_the_served_checkpoint_has_a_tokenizer_kvserve_loads(tmp_path):
    gpu.word_tokenizer(tmp_path, 100)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("w5 w99 hello", add_special_tokens=False) == [5, 99, 0]


def test_quant_speed_smoke_checks_its_products(capsys):
    pytest.importorskip("triton")
    argv = ["--smoke", "--formats", "q4_k", "q8_0", "--rows", "1", "--gemv-tiles", "8:256:4:1"]
    assert quant_speed.main(argv) == 0
    table = capsys.readouterr().out
    assert "| q4_k | 1 | gate_up | default | 64 x 256 |" in table
    assert "| q4_k | 1 | gate_up | 1x8x256 w4 s1 | 64 x 256 |" in table and "| q8_0 | 1 |" in table
