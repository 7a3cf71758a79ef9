"""bench.step_products: a Q4_K_M step's matrices, both layouts, against the read bandwidth."""

import pytest
import torch

from bench import step_products
from kernels import cpu

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")


def test_the_step_has_the_models_matrices_in_its_formats():
    mats = step_products.matrices(step_products.Shape(layers=2, hidden=256, ffn=512, kv=64,
                                                      vocab=256))  # fmt: skip
    assert len(mats) == 2 * 4 + 1
    assert [p.format for p in mats[0]] == ["q4_k", "q4_k"]  # q|k in Q4_K, v in layer 0's
    assert [p.format for p in mats[4]] == ["q4_k", "q6_k"]  # layer 1's v in Q6_K
    assert [(p.out_features, p.in_features) for p in mats[3]] == [(256, 512)]  # down
    assert mats[-1][0].format == "q6_k" and mats[-1][0].out_features == 256


def test_every_layout_and_row_count_is_reported_against_one_row(monkeypatch, tmp_path):
    monkeypatch.setattr(step_products, "box_bandwidth", lambda: 1e10)
    shape = step_products.Shape(layers=1, hidden=256, ffn=256, kv=64, vocab=64)
    report = step_products.run([1, 3], ["packed", "file"], 1, shape)
    got = [(r["layout"], r["rows"]) for r in report["results"]]
    assert got == [("packed", 1), ("packed", 3), ("file", 1), ("file", 3)]
    assert all(r["ms"] > 0 and r["weight_gbs"] > 0 for r in report["results"])
    assert [r["of_one_row"] for r in report["results"]][::2] == [1.0, 1.0]
    table = step_products.markdown(report, "cmd")
    assert "| packed | 3 |" in table and report["box"] in table
    torch.testing.assert_close(torch.tensor(report["read_gbs"]), torch.tensor([10.0, 10.0]))
