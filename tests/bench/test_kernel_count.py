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
    # On the backend: each norm joined to the residual add before it, the activation times
    # up, and the decode step's rotary with its cache writes are one kernel each.
    after = kernel_count.count("smollm2-135m", batch=1, context=1024)
    assert after["layer_launches"]["_add_rms_norm_kernel"] == pytest.approx(2 - 1 / 30)
    assert after["layer_launches"]["_rotate_write_kernel"] == 1
    assert after["layer_ops"] == {"linear": 4}
    assert after["per_layer"] == 10


@pytest.mark.parametrize("model", ["llama3-8b-4l", "qwen2.5-1.5b", "gemma3-270m"])
def test_a_decode_layer_is_ten_kernels(model):
    """Four projections, two norms with their residual adds (Gemma's four norms in two), the
    activation, rotary with the cache writes, decode attention and its merge."""
    row = kernel_count.count(model, batch=8, context=4096)
    assert row["per_layer"] <= 10, row
    assert row["layer_ops"] == {"linear": 4}, row


def test_an_mla_decode_layer_is_fourteen_kernels():
    """MLA's seven products (the two projections of the layer's input packed in one, the query
    and output up-projections, the absorbed key and value up-projections, the MLP's two) leave
    room for three kernels of glue beside the norms, activation, attention and merge: the
    query LoRA's norm, and the latent's norm, rotary and cache write with the query's
    assembly. Fewer would need the absorbed up-projections folded into the query and output
    projections, 2.7x and 4x their weight bytes for a step that reads weights."""
    row = kernel_count.count("deepseek-v3-4l", batch=8, context=4096)
    assert row["per_layer"] == 14, row
    assert row["layer_ops"] == {"linear": 5, "einsum": 2}, row
    assert row["layer_launches"]["_latent_rows_kernel"] == 1


def test_the_command_writes_one_row_per_model(tmp_path):
    out = tmp_path / "k"
    assert kernel_count.main(["--models", "qwen2.5-1.5b", "deepseek-v3-4l", "--out", str(out)]) == 0
    table = (tmp_path / "k.md").read_text()
    assert "| qwen2.5-1.5b | 28 |" in table and "| deepseek-v3-4l | 4 |" in table
