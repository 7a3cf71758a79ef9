"""Rotary embedding of a step's queries and keys in one Triton kernel: a program per (token,
head) of either, in the half-split layout of ``kernels.reference.apply_rope`` and its rounding
(in half precision each product and the sum round to the dtype, as torch's operators do). The
torch reference is ten kernels a layer on the GPU (two negations, concatenations, four
products, two sums).

A decode step's whole turn-and-write is one kernel too (``rotate_write_launch``): per-head
norms, rotary and key offset of ``kernels.backend.Rotary`` for queries and keys, the keys and
values stored to their cache slots (``_write_cache_kernel``'s scatter), where the reference
path launches a norm per q and k, the rotary kernel, a subtraction and two cache writes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch
from kernels.triton_norm import _inv_rms, _weigh


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _turn(x1, x2, cos_row, sin_row, d, ok, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """The two halves of a row (fp32) rotated by its position's cos/sin rows."""
    c1 = tl.load(cos_row + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + d, mask=ok, other=0.0).to(tl.float32)
    y1 = _round(x1 * c1, DTYPE) + _round(-x2 * s1, DTYPE)
    y2 = _round(x2 * c2, DTYPE) + _round(x1 * s2, DTYPE)
    return y1, y2


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
    y1, y2 = _turn(x1, x2, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, d, ok, HALF, dtype)
    tl.store(dst + d, y1.to(dtype), mask=ok)
    tl.store(dst + HALF + d, y2.to(dtype), mask=ok)


@triton.jit
def _rotate_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    q_out,
    k_cache,
    v_cache,
    offset_ptr,
    wq_ptr,
    wk_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_kn,
    stride_kb,
    stride_kc,
    stride_vn,
    stride_vb,
    stride_vc,
    eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BS: tl.constexpr,
    NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Programs (token, h): h < HQ a query head, then HK key heads, then HK value heads.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    dtype = q_out.dtype.element_ty
    slot = tl.load(slot_ptr + t)
    if h >= HQ + HK:  # a value row, as it is
        hv = h - HQ - HK
        src = v_ptr + t * stride_vt + hv * stride_vh
        dst = v_cache + (slot // BS) * stride_vn + (slot % BS) * stride_vb + hv * stride_vc
        stored = d < tl.where(slot >= 0, HALF, 0)
        for part in tl.static_range(2):
            x = tl.load(src + part * HALF + d, mask=ok, other=0.0)
            tl.store(dst + part * HALF + d, x.to(v_cache.dtype.element_ty), mask=stored)
    else:
        is_q = h < HQ
        hk = h - HQ
        if is_q:
            src = q_ptr + t * stride_qt + h * stride_qh
        else:
            src = k_ptr + t * stride_kt + hk * stride_kh
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
        if NORM:  # the head's RMSNorm, rounded to the dtype as the reference's output
            if is_q:
                w_ptr = wq_ptr
            else:
                w_ptr = wk_ptr
            w1 = tl.load(w_ptr + d, mask=ok, other=0.0)
            w2 = tl.load(w_ptr + HALF + d, mask=ok, other=0.0)
            inv = _inv_rms(tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0), 2 * HALF, eps)
            x1 = _round(_weigh(x1 * inv, w1, NORM_OFFSET, dtype), dtype)
            x2 = _round(_weigh(x2 * inv, w2, NORM_OFFSET, dtype), dtype)
        c, s = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
        y1, y2 = _turn(x1, x2, c, s, d, ok, HALF, dtype)
        if is_q:
            dst = q_out + (t * HQ + h) * 2 * HALF
            tl.store(dst + d, y1.to(dtype), mask=ok)
            tl.store(dst + HALF + d, y2.to(dtype), mask=ok)
        else:
            if KEY_OFFSET:
                o1 = tl.load(offset_ptr + hk * 2 * HALF + d, mask=ok, other=0.0)
                o2 = tl.load(offset_ptr + hk * 2 * HALF + HALF + d, mask=ok, other=0.0)
                y1 = y1.to(dtype).to(tl.float32) - o1.to(dtype).to(tl.float32)
                y2 = y2.to(dtype).to(tl.float32) - o2.to(dtype).to(tl.float32)
            dst = k_cache + (slot // BS) * stride_kn + (slot % BS) * stride_kb + hk * stride_kc
            cache_dtype = k_cache.dtype.element_ty
            stored = d < tl.where(slot >= 0, HALF, 0)
            tl.store(dst + d, y1.to(dtype).to(cache_dtype), mask=stored)
            tl.store(dst + HALF + d, y2.to(dtype).to(cache_dtype), mask=stored)


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


def rotate_write_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, Launch]:
    """q [T, Hq, D] turned by ``rotary`` (a ``kernels.backend.Rotary``) into a new contiguous
    tensor, k turned likewise and v as it is stored to their float caches [N, bs, Hkv, D] at
    ``slots`` (-1: not stored), and the one launch that does all three. Heads may be strided
    views of a fused projection, as for ``rope_launch``."""
    tokens, hq, dim = q.shape
    hk = k.shape[1]
    assert v.shape[1:] == k.shape[1:] == k_cache.shape[2:] == v_cache.shape[2:], (k.shape, v.shape)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = rotary.cos.contiguous(), rotary.sin.contiguous()
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    offset = rotary.key_offset
    wq, wk, eps, norm_offset = rotary.norms or (None, None, 0.0, 0.0)
    args = (q, k, v, cos, sin, slots, q_out, k_cache, v_cache,
            q if offset is None else offset, q if wq is None else wq, q if wk is None else wk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], eps)  # fmt: skip
    params = dict(HQ=hq, HK=hk, HALF=dim // 2, BS=k_cache.shape[1], NORM=wq is not None,
                  NORM_OFFSET=float(norm_offset), KEY_OFFSET=offset is not None,
                  BLOCK=triton.next_power_of_2(dim // 2),
                  num_warps=1 if dim <= 128 else 2)  # fmt: skip
    return q_out, Launch(_rotate_write_kernel, (tokens, hq + 2 * hk), args, params)
