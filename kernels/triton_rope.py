"""Rotary embedding of a step's queries and keys in one Triton kernel: a program per (token,
head) of either, in the half-split layout of ``kernels.reference.apply_rope`` and its rounding
(in half precision each product and the sum round to the dtype, as torch's operators do). The
torch reference is ten kernels a layer on the GPU (two negations, concatenations, four
products, two sums)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out,
    k_out,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    if h < HQ:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out + (t * HQ + h) * 2 * HALF
    else:
        src = k_ptr + t * stride_kt + (h - HQ) * stride_kh
        dst = k_out + (t * HK + h - HQ) * 2 * HALF
    dtype = q_out.dtype.element_ty
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=ok, other=0.0).to(tl.float32)
    y1 = _round(x1 * c1, dtype) + _round(-x2 * s1, dtype)
    y2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
    tl.store(dst + d, y1.to(dtype), mask=ok)
    tl.store(dst + HALF + d, y2.to(dtype), mask=ok)


def rope_launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """q [T, Hq, D] and k [T, Hk, D] (rows of each head dense, heads and tokens at any stride)
    rotated into new contiguous tensors by cos/sin [T, D], and the launch that writes them."""
    tokens, hq, dim = q.shape
    hk = k.shape[1]
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))
    args = (q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0))  # fmt: skip
    params = dict(HQ=hq, HK=hk, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2),
                  num_warps=1 if dim <= 128 else 2)  # fmt: skip
    return q_out, k_out, Launch(_rope_kernel, (tokens, hq + hk), args, params)
