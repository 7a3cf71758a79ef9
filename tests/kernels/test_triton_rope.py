"""The Triton rotary kernel (``kernels.triton_rope``) against ``kernels.reference.apply_rope``,
under the interpreter on the CPU (on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.backend import LatentRotary, Rotary, TorchBackend, TritonBackend
from models.layers import rope_cos_sin

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 sums may fuse into one rounding where torch rounds twice; half precision rounds every
# product and the sum as torch does. Triton's interpreter casts float32 to bfloat16 by
# truncation (1 + 2^-8 + 2^-9 becomes 1.0, not 1.0078125), whatever rounding is asked for: on
# the CPU bf16 results may be a few units of the operands' last place off.
TOL = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0 if DEVICE == "cuda" else 0.05}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("dim", [64, 72, 128, 256])
def test_queries_and_keys_of_a_fused_projection_rotate_as_the_reference(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    tokens, hq, hk = 5, 4, 2
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(tokens, hk, dim)
    positions = torch.tensor([0, 1, 7, 300, 4095], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    got_q, got_k = TritonBackend().rope(q, k, cos, sin)
    for got, x in ((got_q, q), (got_k, k)):
        # Against float32 arithmetic: a kernel may round each product and the sum to the dtype
        # as torch does, or round once (the GPU build fuses where the interpreter does not).
        exact = reference.apply_rope(x.float(), cos.float(), sin.float())
        bound = _rounding_bound(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        for result in (got, reference.apply_rope(x, cos, sin)):
            excess = (result.float() - exact).abs() - bound
            assert excess.max().item() <= 0, (dtype, excess.argmax().item())


def _rounding_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """How far rounding both products and their sum to x's dtype may move a rotated value:
    half a unit in the last place each, at most eps times the products' magnitudes (a whole
    unit each where the interpreter truncates bfloat16)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1).float()
    terms = (x.float() * cos[:, None].float()).abs() + (rotated * sin[:, None].float()).abs()
    eps = torch.finfo(x.dtype).eps * (2 if x.dtype == torch.bfloat16 and DEVICE == "cpu" else 1)
    return terms * eps


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("norms,key_offset", [(False, False), (True, False), (False, True)])
def test_a_decode_step_turns_and_writes_in_one_launch(dtype, cache_dtype, norms, key_offset):
    """Per-head norms (Gemma), rotary and the key offset (Qwen2 over a quantized cache...) of a
    decode step's q and k, k and v stored to their slots (-1 skipped), as the reference path
    of separate operations leaves them."""
    g = torch.Generator().manual_seed(3)
    tokens, hq, hk, dim, blocks, bs = 3, 4, 2, 64, 3, 4
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], -1)
    q, k, v = q.view(tokens, hq, dim), k.view(tokens, hk, dim), v.view(tokens, hk, dim)
    cos, sin = rope_cos_sin(torch.tensor([5, 0, 900], device=DEVICE),
                            1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE),
                            dtype)  # fmt: skip
    rotary = Rotary(
        cos, sin,
        torch.randn(hk, dim, generator=g).to(DEVICE) * 5 if key_offset else None,
        (torch.randn(dim, generator=g).to(DEVICE, dtype),
         torch.randn(dim, generator=g).to(DEVICE, dtype), 1e-6, 1.0) if norms else None,
    )  # fmt: skip
    slots = torch.tensor([6, -1, 9], device=DEVICE)
    results = []
    for backend in (TorchBackend(), TritonBackend()):
        caches = tuple(torch.zeros(blocks, bs, hk, dim, dtype=cache_dtype, device=DEVICE)
                       for _ in range(2))  # fmt: skip
        results.append((backend.rotate_and_write(q, k, v, rotary, caches, slots), *caches))
    tol = TOL[dtype] if dtype != torch.float16 else 2**-10  # the norm's unit in the last place
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * 4)
    assert results[1][1].flatten(0, 1)[[0, 1, 2, 3, 4, 5, 7, 8, 10, 11]].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_an_mla_decode_step_makes_its_query_and_writes_its_row_in_one_launch(dtype, interleave):
    """The absorbed query beside its rotated part, and the latent normalized beside the
    rotated key in the cache row, as the reference's norm, rotations and concatenations."""
    g = torch.Generator().manual_seed(11)
    tokens, heads, rank, rope, blocks, bs = 3, 4, 48, 16, 2, 4
    q_latent = torch.randn(tokens, heads, rank, generator=g).to(DEVICE, dtype)
    q = torch.randn(tokens, heads, 32 + rope, generator=g).to(DEVICE, dtype)
    q_pe = q[..., 32:]  # the rotary part of q_b_proj's heads: strided
    kv = torch.randn(tokens, rank + rope, generator=g).to(DEVICE, dtype)
    c_kv, k_pe = kv.split([rank, rope], -1)
    freqs = torch.tensor([3.0, 0.0, 700.0])[:, None] * 0.9 ** torch.arange(rope // 2)
    cos, sin = (f(freqs).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    weight = torch.randn(rank, generator=g).to(DEVICE, dtype)
    rotary = LatentRotary(cos, sin, interleave, (weight, 1e-6))
    slots = torch.tensor([5, -1, 2], device=DEVICE)
    results = []
    for backend in (TorchBackend(), TritonBackend()):
        cache = torch.zeros(blocks, bs, 1, rank + rope, dtype=dtype, device=DEVICE)
        kv_cache = (cache, cache[..., :rank])
        query = backend.latent_rows_and_write(q_latent, q_pe, c_kv, k_pe, rotary, kv_cache, slots)
        results.append((query, cache))
    tol = 2 * 2**-7 if dtype == torch.bfloat16 else 1e-5
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * 4)
    assert results[1][1].flatten(0, 1)[[0, 1, 3, 4, 6, 7]].abs().sum() == 0
