"""bench.kernel_count: a decode step's CUDA kernels counted on the meta device."""

from __future__ import annotations

import pytest

from bench import kernel_count

pytest.importorskip("triton")


def test_smollm2_layer_counts_what_its_h100_profile_counted():
    before = kernel_count.count("smollm2-135m", batch=1, context=1024, fused=False)
    # Four projections, two cache writes (k, v), a split decode and its merge per layer.
    assert before["layer_ops"]["linear"] == 4
    assert before["layer_launches"] == {
        "_write_cache_kernel": 2, "_decode_kernel": 1, "_merge_kernel": 1
    }  # fmt: skip
    assert before["per_layer"] * before["layers"] + before["outside"] == before["total"]
    assert sum(before["launches"].values()) == 4 * before["layers"]
    # torch.profiler on an H100 counted 1,312 kernels in this model's bf16 decode step, about
    # 44 a layer, with the norms and rotary by torch (../shared/gpu-h100-2026-11-26/diag.md, the
    # sampler's included): the count comes within a few of it.
    assert 0.85 * 1312 <= before["total"] <= 1312 and 0.85 * 44 <= before["per_layer"] <= 44
    # On the backend, each of a layer's two norms is one kernel instead of eight operators,
    # and the rotation of its queries and keys one instead of ten.
    after = kernel_count.count("smollm2-135m", batch=1, context=1024)
    assert after["layer_launches"]["_rms_norm_kernel"] == 2
    assert after["layer_launches"]["_rope_kernel"] == 1
    assert after["per_layer"] == before["per_layer"] - 2 * 7 - 9 == 15


def test_the_command_writes_one_row_per_model(tmp_path):
    out = tmp_path / "k"
    assert kernel_count.main(["--models", "qwen2.5-1.5b", "deepseek-v3-4l", "--out", str(out)]) == 0
    table = (tmp_path / "k.md").read_text()
    assert "| qwen2.5-1.5b | 28 |" in table and "| deepseek-v3-4l | 4 |" in table
