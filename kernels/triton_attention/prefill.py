"""Prefill kernels: query tiles of new tokens over their cached prefix and, causally, over the
chunk's own keys (``_prefill_kernel``), and the importance scores after them."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_attention.attend import _add_scores, _attend, _load_query
from kernels.triton_attention.formats import _FLOAT


@triton.jit
def _query_tile(cu_ptr, num_seqs, BLOCK_Q: tl.constexpr, BLOCK_SEQS: tl.constexpr):
    """The sequence whose query tile this program takes (axis 0), its first row, its row
    count, and the tile's first row in it.

    Query tiles of all sequences share axis 0 without a host-side max length: sequence i owns
    tiles from cu[i] // BLOCK_Q + i on, which leaves room for its ceil(n_i / BLOCK_Q) tiles.
    The owner is the number of sequences starting at or before the tile, less one, counted
    BLOCK_SEQS at a time (a fixed width: the batch size does not pick a variant)."""
    tile = tl.program_id(0)
    seq = tl.full([], -1, tl.int32)
    for first in range(0, num_seqs, BLOCK_SEQS):
        seqs = first + tl.arange(0, BLOCK_SEQS)
        cu = tl.load(cu_ptr + seqs, mask=seqs < num_seqs, other=2**30)
        seq += tl.sum((cu // BLOCK_Q + seqs <= tile).to(tl.int32), 0)
    q_start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - q_start
    q0 = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q
    return seq, q_start, n, q0


# Step-dependent scalars (batch size, table width) and the index arrays sliced per step are not
# specialized on, so that no step compiles a variant of its own.
@triton.jit(
    do_not_specialize=["ring_len", "num_seqs", "stride_tb"],
    do_not_specialize_on_alignment=["table_ptr", "cu_ptr", "prefix_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    cu_ptr,
    prefix_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    window,
    ring_len,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_kcd,
    stride_vcn,
    stride_vcb,
    stride_vch,
    stride_vcd,
    stride_tb,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SHARED_V: tl.constexpr,
    SHARED_V_NEW: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV: tl.constexpr,
    KV_V: tl.constexpr,
    ALIGN: tl.constexpr,
    SHIFT: tl.constexpr = 0,
):
    # SHIFT: each row reads only keys at least SHIFT positions before its own (and ``window``
    # counts from there): the older keys of a layer whose last SHIFT tokens are read from
    # recent rows (``recent_prefill_launches``).
    seq, q_start, n, q0 = _query_tile(cu_ptr, num_seqs, BLOCK_Q, BLOCK_SEQS)
    tile_ok = q0 < n
    prefix = tl.load(prefix_ptr + seq)

    kv_head = tl.program_id(1) // HEAD_TILES
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q0 + rows // BLOCK_G
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + rows % BLOCK_G
    row_ok = (q_idx < n) & (g < GROUP)
    head = kv_head * GROUP + g
    token = (q_start + q_idx).to(tl.int64)

    k_head = kv_head * stride_kch
    v_head = kv_head * stride_vch
    if KV == _FLOAT:
        dot_dtype = k_ptr.dtype.element_ty
    else:
        dot_dtype = q_ptr.dtype.element_ty
        k_head = tl.multiple_of(k_head, ALIGN)
        v_head = tl.multiple_of(v_head, ALIGN)
    q_row = token * stride_qt + head * stride_qh
    q1, q2 = _load_query(
        q_ptr, q_row, row_ok, stride_qd, dot_dtype, D1, D2, BLOCK_D1, BLOCK_D2, UPCAST,
    )  # fmt: skip

    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)

    lo = 0
    if WINDOWED:
        lo = tl.maximum(prefix + q0 - SHIFT - window + 1, 0)
    hi = tl.where(tile_ok, prefix, lo)
    # Every cached position precedes every row: the window is the only per-row mask (and, with
    # a shift, the causal one).
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, prefix + q_idx - SHIFT, k_cache_ptr + k_head,
        v_cache_ptr + v_head,
        table_ptr + seq.to(tl.int64) * stride_tb, ring_len,
        lo, hi, window, qk_scale, stride_kcn, stride_kcb, stride_kcd, stride_vcn, stride_vcb,
        stride_vcd,
        PAGED=True, TILE_IN_BLOCK=False, SHARED_V=SHARED_V, BS=BS, RING=WINDOWED,
        CAUSAL=SHIFT > 0, WINDOWED=WINDOWED,
        D1=D1, D2=D2, DV=DV, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, KV_V=KV_V,
        ALIGN=ALIGN,
    )  # fmt: skip

    # The chunk's own keys come from k/v (not yet in the cache), causally, by row index.
    j_lo = 0
    if WINDOWED:
        j_lo = tl.maximum(q0 - SHIFT - window + 1, 0)
    j_hi = tl.where(tile_ok, tl.minimum(n, q0 + BLOCK_Q), j_lo)
    first = q_start.to(tl.int64)
    k_new = first * stride_kt + kv_head * stride_kh
    v_new = first * stride_vt + kv_head * stride_vh
    if KV != _FLOAT:
        k_new = tl.multiple_of(k_new, ALIGN)
        v_new = tl.multiple_of(v_new, ALIGN)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, q_idx - SHIFT, k_ptr + k_new, v_ptr + v_new, table_ptr, ring_len,
        j_lo, j_hi, window, qk_scale, stride_kt, 0, stride_kd, stride_vt, 0, stride_vd,
        PAGED=False, TILE_IN_BLOCK=False, SHARED_V=SHARED_V_NEW, BS=BS, RING=False, CAUSAL=True,
        WINDOWED=WINDOWED,
        D1=D1, D2=D2, DV=DV, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, KV_V=KV_V,
        ALIGN=ALIGN,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # Stored flat, as in decode: the row indices are derived anew from one range here.
    flat = tl.arange(0, BLOCK_Q * BLOCK_G * BLOCK_DV)
    row = flat // BLOCK_DV
    col = flat % BLOCK_DV
    q_idx = q0 + row // BLOCK_G
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + row % BLOCK_G
    o_ptrs = (
        out_ptr + (q_start + q_idx).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
    )
    mask = (q_idx < n) & (g < GROUP) & (col < DV)
    out = tl.reshape(out, [BLOCK_Q * BLOCK_G * BLOCK_DV])
    tl.store(o_ptrs + col * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)

    # Each row's log-sum-exp, for ``_prefill_scores_kernel`` (a store per row: kept whatever
    # the step, so that scoring compiles no second variant of this kernel).
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q0 + rows // BLOCK_G
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + rows % BLOCK_G
    lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))
    lse_ptrs = lse_ptr + (q_start + q_idx).to(tl.int64) * num_heads + kv_head * GROUP + g
    tl.store(lse_ptrs, lse, mask=(q_idx < n) & (g < GROUP))


@triton.jit(
    do_not_specialize=["num_seqs", "stride_tb"],
    do_not_specialize_on_alignment=["table_ptr", "cu_ptr", "prefix_ptr", "score_from_ptr"],
)
def _prefill_scores_kernel(
    q_ptr,
    k_ptr,
    k_cache_ptr,
    table_ptr,
    cu_ptr,
    prefix_ptr,
    score_from_ptr,
    lse_ptr,
    scores_ptr,
    qk_scale,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_kcd,
    stride_tb,
    stride_sn,
    stride_sb,
    stride_sh,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BS: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # The prefill kernel's grid, run after it: the rows at or after score_from read the keys
    # they attended to again (the cached prefix, then the chunk's own keys up to themselves),
    # their logits made probabilities by the rows' log-sum-exps that the prefill stored.
    seq, q_start, n, q0 = _query_tile(cu_ptr, num_seqs, BLOCK_Q, BLOCK_SEQS)
    prefix = tl.load(prefix_ptr + seq)
    kv_head = tl.program_id(1) // HEAD_TILES
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q0 + rows // BLOCK_G
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + rows % BLOCK_G
    row_ok = (q_idx < n) & (g < GROUP)
    counted = row_ok & (prefix + q_idx >= tl.load(score_from_ptr + seq))
    head = kv_head * GROUP + g
    token = (q_start + q_idx).to(tl.int64)
    lse = tl.load(lse_ptr + token * num_heads + head, mask=counted, other=0.0)

    k_head = kv_head * stride_kch
    k_new = q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    if KV == _FLOAT:
        dot_dtype = k_ptr.dtype.element_ty
    else:
        dot_dtype = q_ptr.dtype.element_ty
        k_head = tl.multiple_of(k_head, ALIGN)
        k_new = tl.multiple_of(k_new, ALIGN)
    q1, q2 = _load_query(
        q_ptr, token * stride_qt + head * stride_qh, row_ok, stride_qd, dot_dtype, D1, D2,
        BLOCK_D1, BLOCK_D2, UPCAST,
    )  # fmt: skip

    # A tile none of whose rows counts visits no key.
    some = tl.max(counted.to(tl.int32), 0) > 0
    table = table_ptr + seq.to(tl.int64) * stride_tb
    scores = scores_ptr + kv_head * stride_sh
    _add_scores(
        q1, q2, q_idx, lse, counted, k_cache_ptr + k_head, table, scores,
        0, tl.where(some, prefix, 0), 0, qk_scale, stride_kcn, stride_kcb, stride_kcd, stride_sn,
        stride_sb,
        PAGED=True, CAUSAL=False, BS=BS, D1=D1, D2=D2, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1,
        BLOCK_D2=BLOCK_D2, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip
    _add_scores(
        q1, q2, q_idx, lse, counted, k_ptr + k_new, table, scores,
        0, tl.where(some, tl.minimum(n, q0 + BLOCK_Q), 0), prefix, qk_scale, stride_kt, 0,
        stride_kd, stride_sn, stride_sb,
        PAGED=False, CAUSAL=True, BS=BS, D1=D1, D2=D2, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1,
        BLOCK_D2=BLOCK_D2, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip
