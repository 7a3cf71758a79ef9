"""Rotary embedding of a step's queries and keys in one Triton kernel: a program per token and
tile of heads of either, in the half-split layout of ``kernels.reference.apply_rope`` and its
rounding (in half precision each product and the sum round to the dtype, as torch's do). The
torch reference is ten kernels a layer on the GPU (two negations, concatenations, four
products, two sums).

A decode step's whole turn-and-write is one kernel too (``rotate_write_launch``): per-head
norms, rotary and key offset of ``kernels.backend.Rotary`` for queries and keys, the keys and
values stored to their cache slots (``_write_cache_kernel``'s scatter), where the reference
path launches a norm per q and k, the rotary kernel, a subtraction and two cache writes; and
an MLA decode step's query and cached row (``latent_rows_write_launch``), where the reference
path launches a norm, two rotations of ten operators, two concatenations and a cache write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch
from kernels.triton_norm import _inv_rms, _normalize, _weigh


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
    BLOCK_H: tl.constexpr,
):
    # Programs (token, tile): a tile of BLOCK_H query heads, then tiles of key heads.
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    q_tiles: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
    d = tl.arange(0, BLOCK)[None, :]
    ok_d = d < HALF
    if tile < q_tiles:
        h = tile * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        ok = (h < HQ) & ok_d
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out + (t * HQ + h) * 2 * HALF
    else:
        h = (tile - q_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        ok = (h < HK) & ok_d
        src = k_ptr + t * stride_kt + h * stride_kh
        dst = k_out + (t * HK + h) * 2 * HALF
    dtype = q_out.dtype.element_ty
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
    c, s = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
    y1, y2 = _turn(x1, x2, c, s, d, ok_d, HALF, dtype)
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
        v_src = v_ptr + t * stride_vt + hv * stride_vh
        v_dst = v_cache + (slot // BS) * stride_vn + (slot % BS) * stride_vb + hv * stride_vc
        v_stored = d < tl.where(slot >= 0, HALF, 0)
        for part in tl.static_range(2):
            x = tl.load(v_src + part * HALF + d, mask=ok, other=0.0)
            tl.store(v_dst + part * HALF + d, x.to(v_cache.dtype.element_ty), mask=v_stored)
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
        if is_q:  # names apart from the other branch's: the cache may be of another dtype
            q_dst = q_out + (t * HQ + h) * 2 * HALF
            tl.store(q_dst + d, y1.to(dtype), mask=ok)
            tl.store(q_dst + HALF + d, y2.to(dtype), mask=ok)
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


@triton.jit
def _latent_rows_kernel(
    latent_ptr,
    q_pe_ptr,
    c_kv_ptr,
    k_pe_ptr,
    cos_ptr,
    sin_ptr,
    w_ptr,
    slot_ptr,
    q_out,
    cache_ptr,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_ph,
    stride_ct,
    stride_kt,
    stride_cs,
    stride_cn,
    stride_cb,
    eps,
    H: tl.constexpr,
    R: tl.constexpr,
    HALF: tl.constexpr,
    BS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Programs (token, h): h < H a query head's row [latent, rotated q_pe], h == H the key's.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    ok_r = r < R
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    if INTERLEAVE:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    dtype = q_out.dtype.element_ty
    c = tl.load(cos_ptr + t * stride_cs + j, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cs + j, mask=ok, other=0.0).to(tl.float32)
    if h < H:
        # Names differ between the branches: Triton wants one type per name across them.
        q_row = tl.load(latent_ptr + t * stride_lt + h * stride_lh + r, mask=ok_r, other=0.0)
        q1, q2 = _turn_pairs(q_pe_ptr + t * stride_pt + h * stride_ph, i1, i2, ok, c, s, dtype)
        q_dst = q_out + (t * H + h) * (R + 2 * HALF)
        tl.store(q_dst + r, q_row.to(dtype), mask=ok_r)
        tl.store(q_dst + R + j, q1.to(dtype), mask=ok)
        tl.store(q_dst + R + HALF + j, q2.to(dtype), mask=ok)
    else:
        x = tl.load(c_kv_ptr + t * stride_ct + r, mask=ok_r, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r, mask=ok_r, other=0.0)
        latent = _normalize(x, w, R, eps, 0.0, dtype)
        y1, y2 = _turn_pairs(k_pe_ptr + t * stride_kt, i1, i2, ok, c, s, dtype)
        slot = tl.load(slot_ptr + t)
        dst = cache_ptr + (slot // BS) * stride_cn + (slot % BS) * stride_cb
        cache_dtype = cache_ptr.dtype.element_ty
        stored = j < tl.where(slot >= 0, HALF, 0)
        tl.store(dst + r, latent.to(dtype).to(cache_dtype), mask=r < tl.where(slot >= 0, R, 0))
        tl.store(dst + R + j, y1.to(dtype).to(cache_dtype), mask=stored)
        tl.store(dst + R + HALF + j, y2.to(dtype).to(cache_dtype), mask=stored)


@triton.jit
def _turn_pairs(src, i1, i2, ok, c, s, DTYPE: tl.constexpr):
    """A rotary part's pairs (columns i1, i2) rotated by cos/sin values c, s."""
    x1 = tl.load(src + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=ok, other=0.0).to(tl.float32)
    y1 = _round(x1 * c, DTYPE) + _round(-x2 * s, DTYPE)
    y2 = _round(x2 * c, DTYPE) + _round(x1 * s, DTYPE)
    return y1, y2


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
    block = triton.next_power_of_2(dim // 2)
    # Heads a program turns: as many as keep a half-row tile within 1,024 values.
    heads = max(1, min(triton.next_power_of_2(max(hq, hk)), 1024 // block))
    tiles = triton.cdiv(hq, heads) + triton.cdiv(hk, heads)
    params = dict(HQ=hq, HK=hk, HALF=dim // 2, BLOCK=block, BLOCK_H=heads,
                  num_warps=1 if heads * block <= 128 else 4)  # fmt: skip
    return q_out, k_out, Launch(_rope_kernel, (tokens, tiles), args, params)


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


def latent_rows_write_launch(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    rotary,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, Launch]:
    """An MLA step's query [T, H, R + P] (``AttentionBackend.latent_rows``) in a new tensor,
    its key rows stored to the float cache [N, bs, 1, R + P] at ``slots`` (-1: not stored),
    and the one launch that does both. ``rotary`` is a ``kernels.backend.LatentRotary``."""
    tokens, heads, rank = q_latent.shape
    half = q_pe.shape[-1] // 2
    assert cache.shape[2:] == (1, rank + 2 * half) and cache.stride(-1) == 1, cache.shape
    q_latent, q_pe, c_kv, k_pe = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q_latent, q_pe, c_kv, k_pe)
    )
    cos, sin = rotary.cos.contiguous(), rotary.sin.contiguous()
    weight, eps = rotary.norm
    out = torch.empty(tokens, heads, rank + 2 * half, dtype=q_latent.dtype, device=q_latent.device)
    args = (q_latent, q_pe, c_kv, k_pe, cos, sin, weight, slots, out, cache,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            c_kv.stride(0), k_pe.stride(0), cos.stride(0), cache.stride(0), cache.stride(1),
            eps)  # fmt: skip
    params = dict(H=heads, R=rank, HALF=half, BS=cache.shape[1], INTERLEAVE=rotary.interleave,
                  BLOCK_R=triton.next_power_of_2(rank), BLOCK=triton.next_power_of_2(half),
                  num_warps=4)  # fmt: skip
    return out, Launch(_latent_rows_kernel, (tokens, heads + 1), args, params)
