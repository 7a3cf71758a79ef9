"""The loops the attention kernels share: the online softmax over a range of keys (``_attend``),
the query load, and the importance scores of a range of keys (``_add_scores``)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_attention.formats import (
    _FLOAT,
    _INT4,
    _load_values,
    _row_scale,
)


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q1,
    q2,
    q_pos,
    k_ptr,
    v_ptr,
    table_ptr,
    ring_len,
    lo,
    hi,
    window,
    qk_scale,
    stride_kn,
    stride_kb,
    stride_kd,
    stride_vn,
    stride_vb,
    stride_vd,
    PAGED: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    SHARED_V: tl.constexpr,
    BS: tl.constexpr,
    RING: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV: tl.constexpr,
    KV_V: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Fold keys at positions [lo, hi) into the online softmax of the query rows.

    PAGED: position p is read from the cache through the block table (a ring when RING).
    Otherwise p is a row index into contiguous k/v (the new tokens of a prefill chunk).
    TILE_IN_BLOCK (paged): the caller guarantees that every tile [start, start + BLOCK_N) lies
    in one cache block (lo is a multiple of BLOCK_N, which divides BS, and no ring), so a tile
    needs one table entry, a scalar, rather than one per key.
    ``q_pos`` are the rows' positions in the same coordinates, for the causal/window masks.
    SHARED_V: v is exactly the power-of-two part of k (MLA's latent), so the K tile is reused.
    KV: the key rows' format, KV_V the value rows' (KV's, or another quantized one); quantized
    rows are bytes (``_load_values``), their starts a multiple of ALIGN bytes apart.
    The loop body is written out rather than split into helpers: the interpreter re-patches
    triton.language on every device-function call, which would dominate the test run time.

    Pipelining: Triton's software pipeliner turns the K/V tile loads into asynchronous copies
    to shared memory (cp.async on sm_80 and sm_90) into ``num_stages - 1`` buffers: with 2
    stages a tile's copy is issued at the end of the previous iteration and waited for at once;
    with 3 the next tile's copy stays in flight while the current tile is multiplied. Their
    addresses come from the block table, read one tile earlier still (``next_*``), so a copy
    is never issued behind a table load of its own iteration (a table load in the same
    iteration costs the pipeline a stage: the K/V copies then get one buffer, not two).
    """
    d1 = tl.arange(0, BLOCK_D1)
    d2 = D1 + tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    ONE_ENTRY: tl.constexpr = PAGED and TILE_IN_BLOCK
    next_block = tl.zeros([BLOCK_N], dtype=tl.int32)
    next_entry = tl.zeros([], dtype=tl.int32)
    if ONE_ENTRY:
        next_entry = tl.load(table_ptr + lo // BS, mask=lo < hi, other=0)
    elif PAGED:
        first = lo + tl.arange(0, BLOCK_N)
        logical = first // BS
        if RING:
            logical = logical % ring_len
        next_block = tl.load(table_ptr + logical, mask=first < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        if ONE_ENTRY:
            block_id = next_entry.to(tl.int64)
            ahead = start + BLOCK_N
            next_entry = tl.load(table_ptr + ahead // BS, mask=ahead < hi, other=0)
            k_off = block_id * stride_kn + (pos % BS) * stride_kb
            v_off = block_id * stride_vn + (pos % BS) * stride_vb
        elif PAGED:
            block = next_block.to(tl.int64)
            ahead = pos + BLOCK_N
            logical = ahead // BS
            if RING:
                logical = logical % ring_len
            next_block = tl.load(table_ptr + logical, mask=ahead < hi, other=0)
            k_off = block * stride_kn + (pos % BS) * stride_kb
            v_off = block * stride_vn + (pos % BS) * stride_vb
        else:
            k_off = pos.to(tl.int64) * stride_kn
            v_off = pos.to(tl.int64) * stride_vn

        if KV == _FLOAT:
            k_mask = valid[:, None] & (d1 < D1)[None, :]
            k1 = tl.load(k_ptr + k_off[:, None] + d1[None, :] * stride_kd, mask=k_mask, other=0.0)
            k_dot = k1
            if UPCAST:
                k_dot = k_dot.to(tl.float32)
            s = tl.dot(q1, tl.trans(k_dot), input_precision=PRECISION)
            if D2 > 0:
                k_mask = valid[:, None] & (d2 < D1 + D2)[None, :]
                k2 = tl.load(
                    k_ptr + k_off[:, None] + d2[None, :] * stride_kd, mask=k_mask, other=0.0
                )
                if UPCAST:
                    k2 = k2.to(tl.float32)
                s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        else:
            # Byte rows ALIGN-aligned (a multiple of ALIGN bytes apart): wider loads.
            k_off = tl.multiple_of(k_off, ALIGN)
            v_off = tl.multiple_of(v_off, ALIGN)
            k1 = _load_values(k_ptr, k_off, valid, q1.dtype, 0, D1, BLOCK_D1, BLOCK_N, KV)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                k2 = _load_values(k_ptr, k_off, valid, q1.dtype, D1, D2, BLOCK_D2, BLOCK_N, KV)
                s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
            if KV != _INT4:
                k_scale = _row_scale(k_ptr, k_off, valid, KV)
                s = s * k_scale[None, :]
        s = s * qk_scale

        mask = valid[None, :]
        if CAUSAL:
            mask = mask & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            mask = mask & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shifting by 0 keeps exp2 off NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        if KV == _FLOAT:
            if SHARED_V:
                v = k1
            else:
                v_mask = valid[:, None] & (dv < DV)[None, :]
                v = tl.load(
                    v_ptr + v_off[:, None] + dv[None, :] * stride_vd, mask=v_mask, other=0.0
                )
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
        else:
            if SHARED_V:
                v = k1
                if KV != _INT4:
                    p = p * k_scale[None, :]
            else:
                v = _load_values(v_ptr, v_off, valid, q1.dtype, 0, DV, BLOCK_DV, BLOCK_N, KV_V)
                if KV_V != _INT4:
                    p = p * _row_scale(v_ptr, v_off, valid, KV_V)[None, :]
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _load_query(
    q_ptr,
    row_off,
    valid,
    stride_d,
    dtype,
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Query rows as the power-of-two part and the tail of the key width, in ``dtype``."""
    d1 = tl.arange(0, BLOCK_D1)
    d2 = D1 + tl.arange(0, BLOCK_D2)
    ptrs = q_ptr + row_off[:, None]
    q1 = tl.load(ptrs + d1[None, :] * stride_d, mask=valid[:, None] & (d1 < D1)[None, :], other=0.0)
    q2 = tl.load(
        ptrs + d2[None, :] * stride_d, mask=valid[:, None] & (d2 < D1 + D2)[None, :], other=0.0
    )
    q1 = q1.to(dtype)
    q2 = q2.to(dtype)
    if UPCAST:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
    return q1, q2


@triton.jit
def _add_scores(
    q1,
    q2,
    q_idx,
    lse,
    counted,
    k_ptr,
    table_ptr,
    scores_ptr,
    lo,
    hi,
    first_pos,
    qk_scale,
    stride_kn,
    stride_kb,
    stride_kd,
    stride_sn,
    stride_sb,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BS: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Add to the importance scores of keys [lo, hi) the probability each ``counted`` query
    row gives them, summed over the rows: exp2(logit - lse), ``lse`` the row's final
    log2-sum-exp2 (in ``_attend``'s base-2 units).

    Key i sits at position first_pos + i, and its score at that position's slot (through the
    table, never a ring: sliding-window groups keep no scores). PAGED: its row is read from
    the cache there; otherwise it is row i of contiguous k (a prefill chunk's own keys).
    CAUSAL: row r sees keys i <= q_idx[r]. The logits are ``_attend``'s, written out here too
    (see there why). Other programs add to the same keys (the other query and head tiles of a
    sequence, sequences that share a prefix block), so the adds are atomic."""
    d1 = tl.arange(0, BLOCK_D1)
    d2 = D1 + tl.arange(0, BLOCK_D2)
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < hi
        pos = first_pos + idx
        block = tl.load(table_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
        if PAGED:
            k_off = block * stride_kn + (pos % BS) * stride_kb
        else:
            k_off = idx.to(tl.int64) * stride_kn
        if KV == _FLOAT:
            k_mask = valid[:, None] & (d1 < D1)[None, :]
            k1 = tl.load(k_ptr + k_off[:, None] + d1[None, :] * stride_kd, mask=k_mask, other=0.0)
            if UPCAST:
                k1 = k1.to(tl.float32)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                k_mask = valid[:, None] & (d2 < D1 + D2)[None, :]
                k2 = tl.load(
                    k_ptr + k_off[:, None] + d2[None, :] * stride_kd, mask=k_mask, other=0.0
                )
                if UPCAST:
                    k2 = k2.to(tl.float32)
                s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        else:
            k_off = tl.multiple_of(k_off, ALIGN)
            k1 = _load_values(k_ptr, k_off, valid, q1.dtype, 0, D1, BLOCK_D1, BLOCK_N, KV)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                k2 = _load_values(k_ptr, k_off, valid, q1.dtype, D1, D2, BLOCK_D2, BLOCK_N, KV)
                s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
            if KV != _INT4:
                s = s * _row_scale(k_ptr, k_off, valid, KV)[None, :]
        seen = valid[None, :] & counted[:, None]
        if CAUSAL:
            seen = seen & (idx[None, :] <= q_idx[:, None])
        p = tl.where(seen, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        slot = scores_ptr + block * stride_sn + (pos % BS) * stride_sb
        tl.atomic_add(slot, tl.sum(p, 0), mask=valid, sem="relaxed")
