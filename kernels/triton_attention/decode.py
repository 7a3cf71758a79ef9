"""Decode kernels: one query token per sequence over its paged context, split-K
(``_decode_kernel``), the merge of the splits, and the importance scores after them."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_attention.attend import _add_scores, _attend, _load_query
from kernels.triton_attention.formats import _FLOAT


@triton.jit(do_not_specialize=["ring_len", "num_splits", "stride_tb"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    ring_len,
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SHARED_V: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
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
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + tl.arange(0, BLOCK_G)
    head_ok = g < GROUP
    head = kv_head * GROUP + g
    split = tl.program_id(2)

    k_head = kv_head * stride_kh
    v_head = kv_head * stride_vh
    if KV == _FLOAT:
        dot_dtype = k_ptr.dtype.element_ty
    else:
        dot_dtype = q_ptr.dtype.element_ty
        k_head = tl.multiple_of(k_head, ALIGN)
        v_head = tl.multiple_of(v_head, ALIGN)
    q_row = seq.to(tl.int64) * stride_qb + head * stride_qh
    q1, q2 = _load_query(
        q_ptr, q_row, head_ok, stride_qd, dot_dtype, D1, D2, BLOCK_D1, BLOCK_D2, UPCAST,
    )  # fmt: skip

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = lo + split * per_split
    split_hi = tl.minimum(split_lo + per_split, seq_len)

    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + seq_len - 1
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    # The split range already starts inside the window: no per-row window mask.
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, q_pos, k_ptr + k_head, v_ptr + v_head,
        table_ptr + seq.to(tl.int64) * stride_tb, ring_len, split_lo, split_hi, window, qk_scale,
        stride_kn, stride_kb, stride_kd, stride_vn, stride_vb, stride_vd,
        PAGED=True, TILE_IN_BLOCK=not WINDOWED and BS % BLOCK_N == 0, SHARED_V=SHARED_V, BS=BS,
        RING=WINDOWED, CAUSAL=False, WINDOWED=False,
        D1=D1, D2=D2, DV=DV, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, KV_V=KV_V,
        ALIGN=ALIGN,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # The tile is stored flat, its row and column indices derived here from one range, so the
    # per-row indices of the query load do not stay live across the loop (in the widest tiles,
    # MLA's 64 heads, ptxas would spill them).
    flat = tl.arange(0, BLOCK_G * BLOCK_DV)
    row = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + flat // BLOCK_DV
    col = flat % BLOCK_DV
    store_mask = (row < GROUP) & (col < DV)
    out = tl.reshape(out, [BLOCK_G * BLOCK_DV])
    # The log-sum-exp is stored even for one split, for ``_decode_scores_kernel``.
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    first = seq.to(tl.int64) * num_heads * num_splits
    tl.store(part_lse_ptr + first + head * num_splits + split, lse, mask=head_ok)
    if num_splits == 1:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + (kv_head * GROUP + row) * stride_oh
        tl.store(o_ptrs + col * stride_od, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (kv_head * GROUP + row) * num_splits + split
        tl.store(part_out_ptr + first * DV + part * DV + col, out, mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    DV: tl.constexpr,
    MAX_S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # The log-sum-exps of all splits give the max and the total mass; the partial outputs are
    # then summed BLOCK_S splits at a time, so that a program holds BLOCK_S x BLOCK_DV of them
    # rather than MAX_S x BLOCK_DV (which does not fit in registers for wide values).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = (seq.to(tl.int64) * num_heads + head) * num_splits
    split = tl.arange(0, MAX_S)
    lse = tl.load(part_lse_ptr + first + split, mask=split < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m), 0)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        part = start + tl.arange(0, BLOCK_S)
        used = part < num_splits
        weight = tl.exp2(tl.load(part_lse_ptr + first + part, mask=used, other=float("-inf")) - m)
        o_ptrs = part_out_ptr + (first + part)[:, None] * DV + dv[None, :]
        o = tl.load(o_ptrs, mask=used[:, None] & (dv < DV)[None, :], other=0.0)
        acc += tl.sum(weight[:, None] * o, 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dv * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def _decode_scores_kernel(
    q_ptr,
    k_ptr,
    table_ptr,
    seq_lens_ptr,
    score_from_ptr,
    part_lse_ptr,
    scores_ptr,
    qk_scale,
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_tb,
    stride_sn,
    stride_sb,
    stride_sh,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BS: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # The decode kernel's grid and split of the context, run after it: each head's softmax
    # normalizer is final only once every split is done, so the keys are read again here and
    # their logits, less the head's log-sum-exp over all splits, are the probabilities.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    g = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + tl.arange(0, BLOCK_G)
    head_ok = g < GROUP
    head = kv_head * GROUP + g
    split = tl.program_id(2)

    # The splits' log-sum-exps (``_decode_kernel``) combined, BLOCK_S at a time.
    first = (seq.to(tl.int64) * num_heads + head) * num_splits
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        part = start + tl.arange(0, BLOCK_S)
        mask = head_ok[:, None] & (part < num_splits)[None, :]
        lse = tl.load(part_lse_ptr + first[:, None] + part[None, :], mask=mask, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp2(m - m_shift) + tl.sum(tl.exp2(lse - m_shift[:, None]), 1)
        m = m_new
    lse = m + tl.log2(tl.where(total == 0.0, 1.0, total))

    k_head = kv_head * stride_kh
    if KV == _FLOAT:
        dot_dtype = k_ptr.dtype.element_ty
    else:
        dot_dtype = q_ptr.dtype.element_ty
        k_head = tl.multiple_of(k_head, ALIGN)
    q1, q2 = _load_query(
        q_ptr, seq.to(tl.int64) * stride_qb + head * stride_qh, head_ok, stride_qd, dot_dtype,
        D1, D2, BLOCK_D1, BLOCK_D2, UPCAST,
    )  # fmt: skip

    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    # A query before its sequence's score_from adds nothing: no key is visited.
    counted = seq_len - 1 >= tl.load(score_from_ptr + seq)
    hi = tl.where(counted, tl.minimum(lo + per_split, seq_len), lo)
    _add_scores(
        q1, q2, g, lse, head_ok, k_ptr + k_head, table_ptr + seq.to(tl.int64) * stride_tb,
        scores_ptr + kv_head * stride_sh, lo, hi, 0, qk_scale, stride_kn, stride_kb, stride_kd,
        stride_sn, stride_sb,
        PAGED=True, CAUSAL=False, BS=BS, D1=D1, D2=D2, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1,
        BLOCK_D2=BLOCK_D2, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip
