"""RMSNorm in one Triton kernel: a program per row, the row's sum of squares, scale and weight
in registers, in the arithmetic of ``kernels.reference.rms_norm`` (fp32 inside; Llama's weight
multiplies the row rounded to the model's dtype, Gemma's, stored as w - 1, in fp32). The torch
reference is eight kernels a norm on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch


@triton.jit
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
    xf = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps))
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if OFFSET == 0.0:
        y = w.to(dtype).to(tl.float32) * xf.to(dtype).to(tl.float32)
    else:
        y = xf * (w.to(tl.float32) + OFFSET)
    tl.store(out_ptr + row.to(tl.int64) * D + d, y.to(dtype), mask=ok)


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
    block = triton.next_power_of_2(dim)
    args = (x, weight, out, heads, stride_t, stride_h, dim, eps)
    params = dict(OFFSET=float(offset), BLOCK_D=block, num_warps=4 if block <= 1024 else 8)
    return out, Launch(_rms_norm_kernel, (rows,), args, params)
