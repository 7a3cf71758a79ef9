"""``bench.retrieval`` end to end on a tiny random model: every policy at a budget, shift in a
context of the budget, the throughput runs, and kvpress's figures beside ours in the report."""

from __future__ import annotations

import json

import pytest

from bench import needle, retrieval
from tests.helpers import random_prompt

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 96


def dataset(tmp_path) -> str:
    samples = [
        needle.Sample(
            id=f"s{i}",
            length=LENGTH,
            depth=0.5,
            answer="12345",
            prompt_ids=random_prompt(LENGTH, 49152, seed=i),
            needle_start=40,
            needle_end=50,
        )
        for i in range(2)
    ]
    path = tmp_path / "needle.json"
    needle.save(needle.Dataset(samples, {"format": needle.FORMAT, "model": "tiny"}), path)
    return str(path)


def test_the_report_puts_every_policy_and_kvpress_side_by_side(worded_llama_dir, tmp_path):
    peer = tmp_path / "kvpress.json"
    peer.write_text(json.dumps({
        "summary": [dict(press="snapkv", ratio=0.5, accuracy=0.85, prompts=20)],
        "throughput": [dict(press="none", ratio=0.0, prompts=2, output_tokens=8, threads=2,
                            output_tok_s=3.5)],
    }))  # fmt: skip
    out = tmp_path / "r"
    retrieval.main([
        "--dataset", dataset(tmp_path), "--model", str(worded_llama_dir), "--policies",
        "snapkv", "sink", "shift", "snapkv-layer", "--budgets", "0.5", "--max-model-len", "256",
        "--throughput", "--concurrent", "2", "--max-tokens", "4", "--pool-tokens", "256",
        "--kvpress", str(peer), "--out", str(out),
    ])  # fmt: skip
    table = out.with_suffix(".md").read_text()
    assert table.startswith(f"# Needle retrieval under KV eviction ({worded_llama_dir})")
    assert "| snapkv | 50% |" in table and "| 85% (of 20) |" in table
    assert "| sink | 50% |" in table and "| shift | 50% |" in table
    assert "| snapkv-layer | 50% |" in table
    assert "| kvpress none | 100% | 3.5 |" in table
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["policy"], r["budget"]) for r in data["accuracy"]] == [
        ("full", 0.0), ("snapkv", 0.5), ("sink", 0.5), ("shift", 0.5), ("snapkv-layer", 0.5)
    ]  # fmt: skip
    assert all(len(r["rows"]) == 2 for r in data["accuracy"])
    tput = data["throughput"]
    assert [(t["policy"], t["budget"]) for t in tput] == [("full", 0.0), ("snapkv", 0.5)]
    assert all(t["tok_s"] > 0 for t in tput)
