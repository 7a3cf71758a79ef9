"""The KV-cache formats' torch reference (``kernels.kv_quant``): byte layouts against
independent encoders (gguf's Q4_0, torch's own float8 cast), error bounds, the rotation, value
prefixes (MLA), and the reference ops that read and write caches in every format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import kv_quant, reference
from kernels.rotary import RopeLayout, rotate_reference
from models.kv_spec import KV_DTYPES, row_bytes

QUANTIZED = ("int8", "fp8_e4m3", "int4")
ALL = tuple(d for d in KV_DTYPES if d != "float32")


def rows(*shape, seed=0, outliers=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # a few large channels, as real keys have
        x[..., 3] *= 20
        x[..., -5] *= 8
    return x


@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("dim", [32, 64, 128, 576])
def test_rows_take_the_bytes_the_spec_counts(name, dim):
    stored = kv_quant.quantize(rows(3, 2, dim), kv_quant.KV_DTYPES[name])
    assert stored.dtype == kv_quant.KV_DTYPES[name]
    assert stored.shape[-1] * stored.element_size() == row_bytes(name, dim)
    assert kv_quant.value_dim(stored) == dim


def test_int8_rows_are_a_float32_scale_then_the_rotated_values():
    x = kv_quant.rotate(rows(4, 64))
    stored = kv_quant.quantize(rows(4, 64), torch.int8)
    scale = stored[:, :4].contiguous().view(torch.float32)[:, 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    q = stored[:, 4:].to(torch.int32)
    assert int(q.abs().max()) == 127
    assert torch.equal(q, torch.round(x / scale[:, None]).to(torch.int32))


def test_fp8_rows_are_a_float32_scale_then_torchs_e4m3_of_the_rotated_scaled_values():
    x = kv_quant.rotate(rows(4, 64))
    stored = kv_quant.quantize(rows(4, 64), torch.float8_e4m3fn)
    scale = stored[:, :4].contiguous().view(torch.float32)
    expect = (x * (448 / x.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn)
    assert torch.equal(stored[:, 4:].view(torch.uint8), expect.view(torch.uint8))
    torch.testing.assert_close(scale[:, 0], x.abs().amax(-1) / 448)


def test_int4_groups_are_gguf_q4_0_blocks_of_the_rotated_row():
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = rows(5, 128)
    stored = kv_quant.quantize(x, torch.uint8)
    rotated = kv_quant.rotate(x).numpy().astype(np.float32)
    expect = quants.quantize(rotated, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(stored.numpy(), expect)
    back = quants.dequantize(expect, gguf.GGMLQuantizationType.Q4_0)
    torch.testing.assert_close(kv_quant.dequantize(stored), kv_quant.rotate(torch.from_numpy(back)))


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 576])
def test_the_rotation_is_orthonormal_symmetric_and_blockwise(dim):
    h = kv_quant.hadamard(dim)
    torch.testing.assert_close(h @ h, torch.eye(dim), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)
    block = 64 if dim % 64 == 0 else 32
    assert torch.count_nonzero(h[0]) == block


@pytest.mark.parametrize(
    ("name", "bound"), [("float16", 1e-3), ("bfloat16", 8e-3), ("int8", 6e-3), ("fp8_e4m3", 3e-2),
                        ("int4", 0.1)],
)  # fmt: skip
def test_read_back_error_is_the_formats(name, bound):
    x = rows(64, 2, 64)  # with outlier channels, which the rotation spreads
    back = kv_quant.fake_quantize(x, kv_quant.KV_DTYPES[name])
    assert back.dtype == x.dtype
    rel = float((back - x).norm() / x.norm())
    assert 0 < rel < bound


def test_rotation_halves_the_int4_error_of_rows_with_outlier_channels():
    x = rows(256, 64)
    rotated = kv_quant.dequantize(kv_quant.quantize(x, torch.uint8))
    g = x.reshape(-1, 32)  # the same groups without the rotation (Q4_0 as it is)
    d = torch.gather(g, 1, g.abs().argmax(1, keepdim=True)) / -8
    plain = (torch.floor(g / d + 8.5).clamp(max=15) - 8) * d
    assert (rotated - x).norm() < 0.5 * (plain.reshape(x.shape) - x).norm()


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_row_prefix_reads_as_a_row_of_its_first_values(name):
    """MLA's values are the first kv_lora_rank values of its key rows."""
    dtype = kv_quant.KV_DTYPES[name]
    stored = kv_quant.quantize(rows(3, 1, 576), dtype)
    prefix = stored[..., : row_bytes(name, 512)]
    assert kv_quant.value_dim(prefix) == 512
    torch.testing.assert_close(
        kv_quant.dequantize(prefix), kv_quant.dequantize(stored)[..., :512], rtol=1e-6, atol=1e-6
    )


def test_an_int4_prefix_with_other_rotation_blocks_is_refused():
    kv_quant.check_prefix(torch.uint8, 576, 512)
    with pytest.raises(ValueError, match="rotation blocks"):
        kv_quant.check_prefix(torch.uint8, 96, 64)


def test_zero_rows_and_no_rows():
    for name in ALL:
        stored = kv_quant.quantize(torch.zeros(2, 64), kv_quant.KV_DTYPES[name])
        assert torch.equal(kv_quant.dequantize(stored), torch.zeros(2, 64))
        for shape in ((0, 2, 64), (0, 64)):
            none = kv_quant.quantize(torch.zeros(shape), kv_quant.KV_DTYPES[name])
            assert none.shape[:-1] == shape[:-1] and kv_quant.dequantize(none).shape == shape


@pytest.mark.parametrize("name", ALL)
def test_the_reference_writes_quantized_rows_and_reads_them_back(name):
    dtype = kv_quant.KV_DTYPES[name]
    cache = torch.zeros(4, 8, 2, row_bytes(name, 64) // dtype.itemsize, dtype=dtype)
    new = rows(5, 2, 64)
    slots = torch.tensor([3, -1, 9, 17, 30])
    reference.write_cache(cache, new, slots)
    flat = cache.view(32, 2, -1)
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], kv_quant.quantize(new[keep], dtype))
    table = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    got = reference.gather_cache(cache, table, slots[keep])
    torch.testing.assert_close(got, kv_quant.fake_quantize(new[keep], dtype).float())


@pytest.mark.parametrize("name", ALL)
def test_prefill_reads_its_own_keys_as_the_cache_gives_them_back(name):
    """A chunk attending to its own new tokens sees what a decode would read from the cache."""
    dtype = kv_quant.KV_DTYPES[name]
    q, k, v = rows(6, 4, 64, seed=1), rows(6, 2, 64, seed=2), rows(6, 2, 64, seed=3)
    cache = torch.zeros(2, 8, 2, row_bytes(name, 64) // dtype.itemsize, dtype=dtype)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    out = reference.prefill_attention(
        q, k, v, cache, cache.clone(), table, torch.tensor([0, 6], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), 0.125,
    )  # fmt: skip
    kq, vq = kv_quant.fake_quantize(k, dtype), kv_quant.fake_quantize(v, dtype)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(out, reference._attend(q, kq, vq, 0.125, mask))


@pytest.mark.parametrize("name", ALL)
def test_shifting_a_quantized_cache_rotates_its_dequantized_keys(name):
    """Re-rotation is exact to the values read back, then stored again in the format."""
    dtype = kv_quant.KV_DTYPES[name]
    keys = rows(3, 8, 2, 64)
    cache = kv_quant.quantize(keys, dtype)
    layout = RopeLayout(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    before, stored = kv_quant.dequantize(cache), cache.clone()
    blocks = torch.tensor([0, 2])
    rotate_reference(cache, blocks, 5, layout)
    expect = before.clone()
    rotate_reference_float = before[blocks].clone()
    rotate_reference(rotate_reference_float, torch.arange(2), 5, layout)
    expect[blocks] = rotate_reference_float
    assert torch.equal(cache[1], stored[1])  # a block not shifted is untouched
    assert torch.equal(cache[blocks], kv_quant.quantize(expect[blocks], dtype))
