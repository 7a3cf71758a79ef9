"""The Triton RMSNorm (``kernels.triton_norm``) against ``kernels.reference.rms_norm``, the
torch path's, under the interpreter on the CPU (on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.backend import TritonBackend

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 differs from the reference by the order of the sum of squares; a half-precision result
# by a unit in the last place of the normalized row (Llama rounds it before the weight) and one
# of the output, where the fp32 values straddle a rounding boundary: two units, relative.
TOL = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dim", [64, 72, 256, 576])
def test_rows_equal_the_reference(dtype, offset, dim):
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(5, dim, generator=g) * 3).to(DEVICE, dtype)
    weight = (torch.randn(dim, generator=g) * 0.5 + (0 if offset else 1)).to(DEVICE, dtype)
    got = TritonBackend().rms_norm(x, weight, 1e-6, offset)
    expected = reference.rms_norm(x, weight, 1e-6, offset)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_heads_read_as_strided_views_of_a_fused_projection():
    """Gemma's q and k norms take heads out of the qkv projection's output, rows apart."""
    qkv = torch.randn(3, (4 + 2 * 2) * 32, device=DEVICE)
    q = qkv[:, : 4 * 32].view(3, 4, 32)
    k = qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32)
    weight = torch.randn(32, device=DEVICE)
    for x in (q, k):
        assert not x.is_contiguous()
        got = TritonBackend().rms_norm(x, weight, 1e-6, 1.0)
        torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-6, 1.0))


def test_more_dims_and_no_rows():
    weight = torch.randn(16, device=DEVICE)
    x = torch.randn(2, 3, 4, 16, device=DEVICE)
    got = TritonBackend().rms_norm(x, weight, 1e-5, 0.0)
    torch.testing.assert_close(got.view(x.shape), reference.rms_norm(x, weight, 1e-5, 0.0))
    empty = torch.empty(0, 16, device=DEVICE)
    assert TritonBackend().rms_norm(empty, weight, 1e-5, 0.0).shape == (0, 16)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("offset,before", [(0.0, False), (1.0, False), (1.0, True)])
def test_residual_add_and_norm_equal_the_reference(dtype, offset, before):
    """The residual add joined to the next norm (Gemma's: the sublayer's own norm first); the
    sum is the stream the next layer adds to, so it must equal torch's add exactly."""
    g = torch.Generator().manual_seed(7)
    dim = 72
    x, residual = ((torch.randn(4, dim, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    weight, first = (torch.randn(dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    first = first if before else None
    got, got_sum = TritonBackend().add_rms_norm(x, residual, weight, 1e-6, offset, first)
    expected, expected_sum = reference.add_rms_norm(x, residual, weight, 1e-6, offset, first)
    assert got.dtype == got_sum.dtype == dtype and got.shape == got_sum.shape == x.shape
    # With the sublayer's norm first, the sum inherits that norm's unit in the last place; the
    # interpreter's bfloat16 casts truncate (``test_triton_rope``), a unit off on the CPU.
    truncated = dtype == torch.bfloat16 and DEVICE == "cpu"
    sum_tol = TOL[dtype] if before or truncated else 0.0
    torch.testing.assert_close(got_sum, expected_sum, rtol=sum_tol, atol=sum_tol * 3)
    tol = TOL[dtype] * (2 if truncated else 1)  # a truncated sum, normalized
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
