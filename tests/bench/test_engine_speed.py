"""bench.engine_speed's dtype comparison on a tiny model with a real tokenizer."""

from __future__ import annotations

from bench import engine_speed


def test_dtypes_are_compared_side_by_side(worded_llama_dir, capsys):
    argv = ["--model", str(worded_llama_dir), "--dtypes", "float32", "bfloat16", "--tokens", "3",
            "--repeats", "1", "--concurrency", "1", "2"]  # fmt: skip
    assert engine_speed.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:3] for r in rows] == [
        ["1", "float32", "float16"], ["1", "bfloat16", "bfloat16"],
        ["2", "float32", "float16"], ["2", "bfloat16", "bfloat16"],
    ]  # fmt: skip
    assert all(float(r[3]) > 0 for r in rows) and rows[0][4] == rows[2][4] == "1.00"
