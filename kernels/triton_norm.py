"""RMSNorm in one Triton kernel, alone or with the residual add before it: a program per row,
the row's sum of squares, scale and weight in registers, in the arithmetic of
``kernels.reference.rms_norm`` and ``add_rms_norm`` (fp32 inside; Llama's weight multiplies the
row rounded to the model's dtype, Gemma's, stored as w - 1, in fp32; the sum rounded to the
dtype as torch's add rounds it). The torch reference is eight kernels a norm on the GPU, and
the residual add one more."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch


@triton.jit
def _inv_rms(sum_squares, D, eps):
    return 1.0 / tl.sqrt_rn(sum_squares / D + eps)


@triton.jit
def _weigh(xf, w, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """A normalized row (fp32) times its weight, as the reference rounds it."""
    if OFFSET == 0.0:
        return w.to(DTYPE).to(tl.float32) * xf.to(DTYPE).to(tl.float32)
    return xf * (w.to(tl.float32) + OFFSET)


@triton.jit
def _normalize(x, w, D, eps, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """x (fp32, zero past D) normalized and weighted by w."""
    return _weigh(x * _inv_rms(tl.sum(x * x, 0), D, eps), w, OFFSET, DTYPE)


# ``heads`` varies between a layer's query and key heads (1 where a model has one KV head):
# left unspecialized, both take one variant.
@triton.jit(do_not_specialize=["heads"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    heads,
    stride_xt,
    stride_xh,
    D,
    eps,
    OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    src = x_ptr + (row // heads).to(tl.int64) * stride_xt + (row % heads) * stride_xh
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    y = _normalize(x, w, D, eps, OFFSET, dtype)
    tl.store(out_ptr + row.to(tl.int64) * D + d, y.to(dtype), mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    before_ptr,
    out_ptr,
    sum_ptr,
    D,
    eps,
    OFFSET: tl.constexpr,
    BEFORE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + d, mask=ok, other=0.0).to(tl.float32)
    if BEFORE:
        wb = tl.load(before_ptr + d, mask=ok, other=0.0)
        x = _normalize(x, wb, D, eps, OFFSET, dtype).to(dtype).to(tl.float32)
    r = tl.load(res_ptr + row + d, mask=ok, other=0.0).to(tl.float32)
    total = (r + x).to(dtype)
    tl.store(sum_ptr + row + d, total, mask=ok)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    y = _normalize(total.to(tl.float32), w, D, eps, OFFSET, dtype)
    tl.store(out_ptr + row + d, y.to(dtype), mask=ok)


def _params(dim: int, offset: float) -> dict:
    block = triton.next_power_of_2(dim)
    return dict(OFFSET=float(offset), BLOCK_D=block, num_warps=4 if block <= 1024 else 8)


def rms_norm_launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, Launch]:
    """``x`` [..., D] normalized into a new contiguous tensor of its shape and dtype, and the
    launch that writes it. Rows of a 3-d x may be strided views (q and k heads out of a fused
    projection); other shapes are read as rows."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() not in (2, 3):
        x = x.reshape(-1, dim)
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_t, stride_h = (x.stride(0), x.stride(1)) if x.dim() == 3 else (x.stride(0), 0)
    rows = out.numel() // dim
    args = (x, weight, out, heads, stride_t, stride_h, dim, eps)
    return out, Launch(_rms_norm_kernel, (rows,), args, _params(dim, offset))


def add_rms_norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    before: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """(normalized, sum) of ``residual + x`` [T, D] as ``reference.add_rms_norm`` makes them
    (x normalized by ``before`` first where given), in new tensors, and the launch that writes
    both."""
    x, residual = x.contiguous(), residual.contiguous()
    dim = x.shape[-1]
    out, total = torch.empty_like(residual), torch.empty_like(residual)
    args = (x, residual, weight, weight if before is None else before, out, total, dim, eps)
    params = dict(_params(dim, offset), BEFORE=before is not None)
    return out, total, Launch(_add_rms_norm_kernel, (residual.numel() // dim,), args, params)
