"""The Triton rotary kernel (``kernels.triton_rope``) against ``kernels.reference.apply_rope``,
under the interpreter on the CPU (on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.backend import TritonBackend
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
        expected = reference.apply_rope(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=TOL[dtype], atol=TOL[dtype])
