"""Triton paged attention: cache write, split-K decode, variable-length prefill over a prefix.

Signatures match ``kernels.reference``. Layouts (see there): caches ``[N, bs, Hkv, D]`` with any
strides (v may be a view of k, as for MLA), block tables ``[B, W]`` int32, a ring of width W when
``window > 0``.

Design:
  - One program owns all query heads of one KV head (or a tile of them when the group is large,
    as MLA's 128 heads): each K/V tile is loaded once and multiplied against the whole group.
  - Softmax is online, in fp32 and base 2 (``scale * log2 e`` folded into the scores).
  - A key width that is not a power of two (576 = 512 + 64) is two dots, a power-of-two part and
    a masked tail, so no lane is wasted on padding to 1024.
  - Decode splits the context into ``num_splits`` parts (flash-decoding) that write a partial
    output and its log-sum-exp; a second kernel merges them. The split count comes from the
    table width, not from ``seq_lens``, so choosing it never waits for the device.
  - K/V tiles are copied to shared memory asynchronously (cp.async), the next one in flight
    while the current one is multiplied (3 stages; see ``_attend``), the block table read a
    tile ahead of the copies.
  - Sliding window: only positions in ``[p - window + 1, p]`` are visited, so the cost per token
    is bounded by the window whatever the context length.
  - Importance scores (``reference``: ``scores``, ``score_from``): a key's probability needs its
    row's final softmax max and sum, known in decode only once its splits are merged. The
    attention kernels store each row's log-sum-exp (decode: each split's), and a scoring kernel
    runs after each on its grid (``_decode_scores_kernel``, ``_prefill_scores_kernel``): it
    reads the keys again (keys only, once per head tile) and turns their logits into the
    probabilities it adds. Keeping the logits instead would take a float per query head and
    context position (gigabytes at long contexts, and stores in the decode loop); recomputing
    costs one more read of K, in scored steps only, and leaves the attention loops and their
    registers as they were (a scoring pass inside the prefill kernel spills on MLA's tile).
    Programs overlap on keys (query and head tiles, shared prefix blocks): the adds are atomic.

Cache formats (``kernels.kv_quant``; the cache dtype names one, ``KV`` in the kernels):
  - A quantized cache is passed to the kernels as bytes (a uint8 view), whatever its dtype: the
    kernels decode int8 and e4m3 themselves, so that sm_80 (no e4m3 type in Triton) and the
    interpreter read them as sm_90 does.
  - Writes quantize in the kernel, one program per token and head row, as ``kv_quant.quantize``.
  - Reads dequantize K/V tiles in registers. int8 and fp8 tiles are converted as they are stored
    and their row scales applied to the scores (keys) and the probabilities (values), one
    multiply per key rather than per value; int4 tiles are scaled per group of 32 as they are
    unpacked, their columns in the order the two nibbles of a byte come out (value j, then
    j + 16), which the query load and the output store follow. Quantized rows are stored
    rotated (``kv_quant.rotated``): the callers rotate the query before and the output after
    (``rotated_query``, ``rotated_output``), so no row is rotated back.
  - dots run in the model's dtype (the query's) over a quantized cache, in the cache's dtype
    over a float one.
  - A prefill chunk's own keys and values are read as the cache gives them back: quantized into
    rows of their own by the write kernel (``read_back_launches``), then read like the cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.launch import Launch, run

_LOG2E = 1.4426950408889634

# Cache formats as the kernels name them (``KV``).
_FLOAT = tl.constexpr(0)
_INT8 = tl.constexpr(1)
_FP8 = tl.constexpr(2)
_INT4 = tl.constexpr(3)
_FORMATS = {torch.int8: _INT8.value, torch.float8_e4m3fn: _FP8.value, torch.uint8: _INT4.value}
# Their layout (``kernels.kv_quant``): int8/fp8 rows lead with a float32 scale; int4 rows are
# groups of 32 values, each a float16 scale then 16 bytes of two values each.
_SCALE_BYTES = tl.constexpr(kv_quant.SCALE_BYTES)
_QGROUP = tl.constexpr(kv_quant.GROUP)
_QGROUP_BYTES = tl.constexpr(kv_quant.GROUP_BYTES)
_FP8_MAX = tl.constexpr(kv_quant.FP8_MAX)


@triton.jit
def _write_cache_kernel(
    cache_ptr,
    rows_ptr,
    slot_ptr,
    stride_cn,
    stride_cb,
    stride_ch,
    stride_cd,
    stride_rt,
    stride_rh,
    stride_rd,
    BS: tl.constexpr,
    D: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    mask = idx < tl.where(slot >= 0, WIDTH, 0)
    h = idx // D
    d = idx % D
    row = tl.load(
        rows_ptr + token.to(tl.int64) * stride_rt + h * stride_rh + d * stride_rd, mask=mask
    )
    dst = cache_ptr + (slot // BS) * stride_cn + (slot % BS) * stride_cb + h * stride_ch
    tl.store(dst + d * stride_cd, row.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_half_even(x):
    # torch.round's rule, from floor: the interpreter has no rint.
    f = tl.floor(x)
    frac = x - f
    up = (frac > 0.5) | ((frac == 0.5) & ((f.to(tl.int32) & 1) != 0))
    return f + up.to(tl.float32)


@triton.jit
def _e4m3_bits(y):
    """float32 |y| <= 448 -> e4m3fn bits, rounded to nearest even as torch casts (by integer
    arithmetic: Triton has no e4m3 type on sm_80)."""
    a = tl.abs(y)
    u = a.to(tl.int32, bitcast=True)
    # Normal: the 3 mantissa bits rounded on the 20 below, the exponent rebased from 127 to 7.
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal (below 2^-6): multiples of 2^-9, and 8 of them is the smallest normal's bits.
    small = _round_half_even(a * 512.0).to(tl.int32)
    mag = tl.where(a < 0.015625, small, normal)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 0x80
    return (mag | sign).to(tl.uint8)


@triton.jit
def _write_quantized_kernel(
    cache_ptr,
    rows_ptr,
    slot_ptr,
    stride_cn,
    stride_cb,
    stride_ch,
    stride_rt,
    stride_rh,
    stride_rd,
    BS: tl.constexpr,
    D: tl.constexpr,
    KV: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token's row of one head into a byte cache, quantized as ``kv_quant.quantize`` does
    (rows arrive rotated). DIRECT: token t is slot t (``read_back_launches``). Its
    divisions round as torch's do (``div_rn``: ``/`` is approximate on the GPU), and it is
    compiled without fused multiply-adds (``_quantize_launch``), which round once where torch
    rounds twice."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if DIRECT:
        slot = token.to(tl.int64)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
    # A skipped slot (-1) writes no value: its row counts as empty.
    width = tl.where(slot >= 0, D, 0)
    src = rows_ptr + token.to(tl.int64) * stride_rt + head * stride_rh
    dst = cache_ptr + (slot // BS) * stride_cn + (slot % BS) * stride_cb + head * stride_ch
    if KV == _INT4:
        # Groups as rows, their first and last 16 values apart: byte j packs value j (low
        # nibble) and value j + 16 (high).
        g = tl.arange(0, BLOCK_D // _QGROUP)
        j = tl.arange(0, _QGROUP // 2)[None, :]
        g_ok = g < width // _QGROUP
        col = g[:, None] * _QGROUP + j
        lo = tl.load(src + col * stride_rd, mask=g_ok[:, None], other=0.0).to(tl.float32)
        hi = tl.load(src + (col + _QGROUP // 2) * stride_rd, mask=g_ok[:, None], other=0.0)
        hi = hi.to(tl.float32)
        # The scale is the group's value of largest magnitude (its first) over -8.
        amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))[:, None]
        first = tl.minimum(
            tl.min(tl.where(tl.abs(lo) == amax, j, _QGROUP), 1),
            tl.min(tl.where(tl.abs(hi) == amax, j + _QGROUP // 2, _QGROUP), 1),
        )[:, None]
        top = tl.sum(tl.where(j == first, lo, 0.0), 1) + tl.sum(
            tl.where(j + _QGROUP // 2 == first, hi, 0.0), 1
        )
        d = top * -0.125
        inv = tl.where(d != 0.0, tl.math.div_rn(1.0, tl.where(d != 0.0, d, 1.0)), 0.0)[:, None]
        q_lo = tl.minimum(tl.floor(lo * inv + 8.5), 15.0).to(tl.uint8)
        q_hi = tl.minimum(tl.floor(hi * inv + 8.5), 15.0).to(tl.uint8)
        group = dst + g[:, None] * _QGROUP_BYTES
        tl.store(group + 2 + j, q_lo | (q_hi << 4), mask=g_ok[:, None])
        bits = d.to(tl.float16).to(tl.uint16, bitcast=True)
        tl.store(dst + g * _QGROUP_BYTES, (bits & 0xFF).to(tl.uint8), mask=g_ok)
        tl.store(dst + g * _QGROUP_BYTES + 1, (bits >> 8).to(tl.uint8), mask=g_ok)
    else:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < width
        x = tl.load(src + d * stride_rd, mask=d_ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        if KV == _INT8:
            top = 127.0
        else:
            top = _FP8_MAX
        # torch divides a number by a tensor as the tensor's reciprocal times the number.
        y = x * tl.where(
            amax > 0.0, tl.math.div_rn(1.0, tl.where(amax > 0.0, amax, 1.0)) * top, 0.0
        )
        if KV == _INT8:
            q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)
            q = q.to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            q = _e4m3_bits(tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX))
        tl.store(dst + _SCALE_BYTES + d, q, mask=d_ok)
        bits = tl.math.div_rn(amax, top).to(tl.uint32, bitcast=True)
        b = tl.arange(0, _SCALE_BYTES)
        tl.store(dst + b, ((bits >> (8 * b).to(tl.uint32)) & 0xFF).to(tl.uint8), mask=b < width)


@triton.jit
def _stored_column(t, PERM: tl.constexpr):
    """The value a tile column holds: itself, or in int4 tiles (PERM) the order in which
    ``_load_values`` unpacks a group, each byte's two values side by side (j, j + 16)."""
    if PERM:
        t = (t // _QGROUP) * _QGROUP + (t % 2) * (_QGROUP // 2) + (t % _QGROUP) // 2
    return t


@triton.jit
def _load_values(
    ptr,
    row_off,
    valid,
    dtype,
    C0: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV: tl.constexpr,
):
    """Values C0 .. C0 + C of the quantized rows at byte offsets ``row_off``, a [BLOCK_N, BLOCK]
    tile of ``dtype`` (zero past C and in rows not ``valid``): int8 and fp8 as stored, without
    their row scale (``_row_scale``), int4 dequantized, in ``_stored_column`` order."""
    if KV == _INT4:
        g = C0 // _QGROUP + tl.arange(0, BLOCK // _QGROUP)
        j = tl.arange(0, _QGROUP // 2)
        g_ok = valid[:, None] & (g < (C0 + C) // _QGROUP)[None, :]
        group = ptr + row_off[:, None] + g[None, :] * _QGROUP_BYTES
        b = tl.load(group[:, :, None] + 2 + j[None, None, :], mask=g_ok[:, :, None], other=0)
        scale = tl.load(group.to(tl.pointer_type(tl.float16)), mask=g_ok, other=0.0)
        lo = (b & 0xF).to(tl.float32) - 8.0
        hi = (b >> 4).to(tl.float32) - 8.0
        x = tl.join(lo, hi) * scale.to(tl.float32)[:, :, None, None]
        x = tl.reshape(x, [BLOCK_N, BLOCK]).to(dtype)
    else:
        col = C0 + tl.arange(0, BLOCK)
        mask = valid[:, None] & (col < C0 + C)[None, :]
        x = tl.load(ptr + row_off[:, None] + _SCALE_BYTES + col[None, :], mask=mask, other=0)
        if KV == _INT8:
            x = x.to(tl.int8, bitcast=True).to(dtype)
        else:
            # e4m3 bits placed in a float16's: exact, 2^8 too small (``_row_scale`` makes up).
            bits = ((x & 0x80).to(tl.uint16) << 8) | ((x & 0x7F).to(tl.uint16) << 7)
            x = bits.to(tl.float16, bitcast=True).to(dtype)
    return x


@triton.jit
def _row_scale(ptr, row_off, valid, KV: tl.constexpr):
    """The float32 scale leading each int8 or fp8 row (zero in rows not ``valid``)."""
    scale = tl.load((ptr + row_off).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
    if KV == _FP8:
        scale = scale * 256.0
    return scale


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
    KV: the rows' format; quantized rows are bytes (``_load_values``), their starts a multiple
    of ALIGN bytes apart.
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
                v = _load_values(v_ptr, v_off, valid, q1.dtype, 0, DV, BLOCK_DV, BLOCK_N, KV)
                if KV != _INT4:
                    p = p * _row_scale(v_ptr, v_off, valid, KV)[None, :]
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
    PERM: tl.constexpr,
):
    """Query rows as the power-of-two part and the tail of the key width, in ``dtype``, their
    columns in the keys' order (``_stored_column``)."""
    d1 = _stored_column(tl.arange(0, BLOCK_D1), PERM)
    d2 = D1 + _stored_column(tl.arange(0, BLOCK_D2), PERM)
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
        KV == _INT4,
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
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # The tile is stored flat, its row and column indices derived here from one range, so the
    # per-row indices of the query load do not stay live across the loop (in the widest tiles,
    # MLA's 64 heads, ptxas would spill them).
    flat = tl.arange(0, BLOCK_G * BLOCK_DV)
    row = (tl.program_id(1) % HEAD_TILES) * BLOCK_G + flat // BLOCK_DV
    col = _stored_column(flat % BLOCK_DV, KV == _INT4)
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
        D1, D2, BLOCK_D1, BLOCK_D2, UPCAST, KV == _INT4,
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
    ALIGN: tl.constexpr,
):
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
        KV == _INT4,
    )  # fmt: skip

    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)

    lo = 0
    if WINDOWED:
        lo = tl.maximum(prefix + q0 - window + 1, 0)
    hi = tl.where(tile_ok, prefix, lo)
    # Every cached position precedes every row: the window is the only per-row mask.
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, prefix + q_idx, k_cache_ptr + k_head, v_cache_ptr + v_head,
        table_ptr + seq.to(tl.int64) * stride_tb, ring_len,
        lo, hi, window, qk_scale, stride_kcn, stride_kcb, stride_kcd, stride_vcn, stride_vcb,
        stride_vcd,
        PAGED=True, TILE_IN_BLOCK=False, SHARED_V=SHARED_V, BS=BS, RING=WINDOWED, CAUSAL=False,
        WINDOWED=WINDOWED,
        D1=D1, D2=D2, DV=DV, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip

    # The chunk's own keys come from k/v (not yet in the cache), causally, by row index.
    j_lo = 0
    if WINDOWED:
        j_lo = tl.maximum(q0 - window + 1, 0)
    j_hi = tl.where(tile_ok, tl.minimum(n, q0 + BLOCK_Q), j_lo)
    first = q_start.to(tl.int64)
    k_new = first * stride_kt + kv_head * stride_kh
    v_new = first * stride_vt + kv_head * stride_vh
    if KV != _FLOAT:
        k_new = tl.multiple_of(k_new, ALIGN)
        v_new = tl.multiple_of(v_new, ALIGN)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, q_idx, k_ptr + k_new, v_ptr + v_new, table_ptr, ring_len,
        j_lo, j_hi, window, qk_scale, stride_kt, 0, stride_kd, stride_vt, 0, stride_vd,
        PAGED=False, TILE_IN_BLOCK=False, SHARED_V=SHARED_V_NEW, BS=BS, RING=False, CAUSAL=True,
        WINDOWED=WINDOWED,
        D1=D1, D2=D2, DV=DV, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, PRECISION=PRECISION, UPCAST=UPCAST, KV=KV, ALIGN=ALIGN,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # Stored flat, as in decode: the row indices are derived anew from one range here.
    flat = tl.arange(0, BLOCK_Q * BLOCK_G * BLOCK_DV)
    row = flat // BLOCK_DV
    col = _stored_column(flat % BLOCK_DV, KV == _INT4)
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
        BLOCK_D1, BLOCK_D2, UPCAST, KV == _INT4,
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


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _split_head_dim(dk: int) -> tuple[int, int]:
    """Key width as a power-of-two part plus a tail (576 -> 512 + 64); tail 0 when dk is 2^k."""
    d1 = 1 << (dk.bit_length() - 1)
    return (d1, dk - d1) if d1 >= 16 else (dk, 0)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _v_is_k_prefix(k: torch.Tensor, v: torch.Tensor, d1: int) -> bool:
    """v is the first d1 values of k's own rows (MLA's latent view)."""
    same_rows = v.shape[:-1] == k.shape[:-1] and v.stride() == k.stride()
    same_start = v.untyped_storage() is k.untyped_storage()
    same_start = same_start and v.storage_offset() == k.storage_offset()
    return same_rows and same_start and kv_quant.value_dim(v) == d1


def _format(cache: torch.Tensor) -> int:
    """The kernels' name for the cache's format (``KV``)."""
    return _FORMATS.get(cache.dtype, _FLOAT.value)


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels read it: a quantized one as bytes."""
    if not kv_quant.is_quantized(cache):
        return cache
    assert cache.stride(-1) == 1, "a quantized cache's rows are contiguous bytes"
    return cache.view(torch.uint8)


def _format_params(*caches: torch.Tensor) -> dict:
    """KV, and ALIGN: the largest power of two up to 16 that every row start of the byte
    caches divides by (their strides but the last), which Triton cannot see in strides that
    are not multiples of 16 (an int8 row of 128 values takes 132 bytes)."""
    align = 16
    for cache in caches:
        if kv_quant.is_quantized(cache):
            for stride in cache.stride()[:-1]:
                while stride % align:
                    align //= 2
    return dict(KV=_format(caches[0]), ALIGN=align)


def _dot_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """What the kernels multiply in: a float cache's dtype, else the model's."""
    return q.dtype if kv_quant.is_quantized(cache) else cache.dtype


def rotated_query(q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """The query as the kernels take it: rotated like the keys of a cache that stores them
    rotated, else as it is."""
    return kv_quant.rotate(q).to(q.dtype) if kv_quant.rotated(k_cache) else q


def rotated_output(out: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' output rotated back where the values were stored rotated (an output then
    float32), in ``dtype``."""
    return kv_quant.rotate(out).to(dtype) if kv_quant.rotated(v_cache) else out


def _out_dtype(q: torch.Tensor, v_cache: torch.Tensor) -> torch.dtype:
    # A rotated output is rounded once, after it is rotated back.
    return torch.float32 if kv_quant.rotated(v_cache) else q.dtype


def _rows_contiguous(block_tables: torch.Tensor) -> torch.Tensor:
    # The kernels step through a table row with stride 1 (a row slice keeps that).
    return block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()


def _interpreted() -> bool:
    return not isinstance(_decode_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class Tile:
    """One program's work: query rows (heads x tokens), keys per iteration, warps, stages."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int = 2


def _dims(dk: int, dv: int) -> dict:
    d1, d2 = _split_head_dim(dk)
    return dict(D1=d1, D2=d2, DV=dv, BLOCK_D1=_pow2(d1), BLOCK_D2=_pow2(d2), BLOCK_DV=_pow2(dv))


def decode_tile(
    dtype: torch.dtype,
    dk: int,
    group: int,
    block_size: int = 16,
    window: int = 0,
    quantized: bool = False,
) -> Tile:
    """Default decode tile, from ``python -m bench.kernel_speed --sweep`` on an H100 (bf16;
    bench/results/), then held within shared memory and free of register spills on sm_90 and
    sm_80 by ``tests/kernels/test_kernel_variants.py``. fp32 dots run on FMA units, so fp32
    tiles are smaller, and from 128 wide on take 8 warps (4 spill on sm_90).

    Every tile has 3 stages: the next K/V tile is copied while the current one is multiplied
    (2 stages copy and then wait, so a program's loads never overlap its math).

    Wide keys (MLA's 576) take up to 64 heads per program on 8 warps, 16 keys a step, so each
    latent row is read once per 64 heads (bench/results/mla-tiles-aot-2026-11-23.md). That
    tile takes ~250 of a thread's 255 registers (its fp32 accumulator alone is 64 x 512 over
    256 threads): it fits only where a step's 16 keys lie in one cache block, whose table
    entry is then one scalar (``block_size`` a multiple of 16, no window ring); elsewhere, and
    in fp32, 32 heads.

    A ``quantized`` cache's tiles are converted in registers (``dtype`` is then the model's):
    from 256 wide on they take 8 warps (head dim 256 on 4 spills on both targets), MLA's 32
    heads and 16 keys a step (64 heads spill hundreds of bytes)."""
    rows, width = min(_pow2(group), 64), _pow2(dk)
    if dtype == torch.float32:
        return Tile(min(rows, 32), 32 if width <= 128 else 16, 4 if width <= 64 else 8, 3)
    if quantized and width > 256:
        return Tile(min(rows, 32), 16, 8, 3)
    if quantized and width == 256:
        return Tile(rows, 32, 8, 3)
    if width > 256:
        if rows > 32 and block_size % 16 == 0 and window == 0:
            return Tile(rows, 16, 8, 3)
        return Tile(min(rows, 32), 32, 8, 3)
    return Tile(rows, 64 if width <= 128 else 32, 4, 3)


def prefill_tile(
    dtype: torch.dtype, dk: int, dv: int, group: int = 1, quantized: bool = False
) -> Tile:
    """Default prefill tile, sized by the ahead-of-time compile of
    ``tests/kernels/test_kernel_variants.py`` for sm_90 and sm_80: within shared memory, no
    register spills. Head dim 256 takes smaller tiles than its neighbours (16 fp32 rows; 16
    keys per step in 16-bit): the larger ones spill on sm_80, where ptxas gives 8 warps 128
    registers each. Tiles take 3 stages (the next K/V tile in flight during the math) except
    16-bit head dims 64 and 256, whose tiles spill with 3 (on sm_80 and sm_90 respectively).

    MLA's keys (576) hold more, but its values are a view of them: no V tile. With 64 or more
    heads per KV head (DeepSeek's 128), a program takes 64 heads of one query, so each latent
    row is read once per 64 heads (bench/results/mla-tiles-aot-2026-11-23.md); with fewer,
    32 rows: the heads of several queries (16 heads: 2 queries). A 64-row tile of several
    queries spills on sm_90 (its rows' positions and indices take the registers), and would
    read each latent row as often as 64 heads of one query.

    Over a ``quantized`` cache MLA takes 16 rows, 32 keys a step: its tiles are converted in
    registers, and wider ones spill on sm_90 (int4's most). Other widths keep their tiles."""
    width = max(_pow2(dk), _pow2(dv))
    if dtype == torch.float32:
        if width == 256:
            return Tile(16, 16, 4, 3)
        return Tile(32, 16, 4 if width <= 64 else 8, 3)
    if quantized and width > 256:
        return Tile(16, 32, 8, 3)
    if width <= 64:
        return Tile(64, 64, 4)
    if width <= 128:
        return Tile(64, 32, 8, 3)
    if width == 256:
        return Tile(32, 16, 8)
    if group >= 64:
        return Tile(64, 16, 8, 3)
    return Tile(32, 32, 8, 3)


def _precision(dtype: torch.dtype) -> dict:
    # fp32 caches are checked against fp32 references: no tf32. Under the interpreter bf16
    # dots run on fp32 copies (it multiplies bf16 bit patterns: triton-lang/triton#11584).
    upcast = dtype != torch.float32 and _interpreted()
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


# Decode programs that stay resident on one SM at once (registers and the 3-stage K/V buffers
# allow 3-5 of the default GQA tiles on an H100, 1 of MLA's): the split plan aims to fill them,
# not just to give each SM one program.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 128
# Partial outputs a merge program holds at once (32 values per thread on its 4 warps).
MERGE_VALUES = 4096
# Splits' log-sum-exps a decode scoring program combines at once.
SCORE_SPLITS = 16
# Sequences a prefill program scans per pass when it looks up which sequence its tile is of.
SEQS_PER_PASS = 64


def choose_num_splits(programs: int, max_context: int, sms: int) -> int:
    """Context splits so ``programs`` x splits fills ``sms`` x PROGRAMS_PER_SM slots, each
    split keeping at least MIN_SPLIT_TOKENS keys (below that the merge costs more than it
    wins). ``max_context`` is an upper bound from the table width: no device sync."""
    wanted = triton.cdiv(sms * PROGRAMS_PER_SM, programs)
    longest = max(1, max_context // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, longest, MAX_SPLITS))


def write_cache_launches(
    cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor
) -> list[Launch]:
    """What ``write_cache`` launches (nothing for no rows). Rows of a rotated format are
    rotated first, by a matmul issued here."""
    num_tokens = rows.shape[0]
    if num_tokens == 0:
        return []
    _, block_size, heads, dim = cache.shape
    if kv_quant.is_quantized(cache):
        return [_quantize_launch(cache, rows, slot_mapping)]
    assert rows.shape[1:] == (heads, dim), (rows.shape, cache.shape)
    width = heads * dim
    block = min(triton.next_power_of_2(width), 1024)
    grid = (num_tokens, triton.cdiv(width, block))
    args = (cache, rows, slot_mapping, *cache.stride(), *rows.stride())
    return [Launch(_write_cache_kernel, grid, args, dict(BS=block_size, D=dim, WIDTH=width,
                                                        BLOCK=block))]  # fmt: skip


def _quantize_launch(
    cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor | None
) -> Launch:
    """Rows [T, H, D] quantized into the cache's slots (``slot_mapping`` None: slot t is row
    t), one program per row of a head."""
    _, block_size, heads, _ = cache.shape
    dim = kv_quant.value_dim(cache)
    assert rows.shape[1:] == (heads, dim), (rows.shape, cache.shape)
    if kv_quant.rotated(cache):
        rows = kv_quant.rotate(rows)
    view = _kernel_view(cache)
    args = (view, rows, rows if slot_mapping is None else slot_mapping, *view.stride()[:3],
            *rows.stride())  # fmt: skip
    params = dict(BS=block_size, D=dim, KV=_format(cache), DIRECT=slot_mapping is None,
                  BLOCK_D=_pow2(dim, 32), enable_fp_fusion=False)  # fmt: skip
    return Launch(_write_quantized_kernel, (rows.shape[0], heads), args, params)


def write_cache(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``rows`` ([T, H, D]) into ``cache`` ([N, bs, H, R]) in its format; slot -1 is
    skipped."""
    run(write_cache_launches(cache, rows, slot_mapping))


def read_back_launches(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """A prefill chunk's new keys and values [T, H, D] as the caches give them back once
    written (``reference.read_back``): rows in the caches' formats, and the launches that
    quantize them (MLA's values are the prefix of the keys' rows)."""
    if k.dtype == k_cache.dtype:
        return k, v, []
    shared = v_cache.untyped_storage() is k_cache.untyped_storage()
    if not kv_quant.is_quantized(k_cache):
        k_new = k.to(k_cache.dtype)
        v_new = k_new[..., : v.shape[-1]] if shared else v.to(v_cache.dtype)
        return k_new, v_new, []
    launches = []

    def written(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        new = rows.new_empty(rows.shape[0], 1, *cache.shape[2:], dtype=cache.dtype)
        if rows.shape[0]:
            launches.append(_quantize_launch(new, rows, None))
        return new[:, 0]

    k_new = written(k, k_cache)
    v_new = k_new[..., : v_cache.shape[-1]] if shared else written(v, v_cache)
    return k_new, v_new, launches


@dataclass(frozen=True)
class LaunchPlan:
    """Launch shape of one decode call: its tile, head tiles per KV head, context splits."""

    tile: Tile
    head_tiles: int
    num_splits: int


def device_sms(device: torch.device) -> int:
    """Multiprocessors a decode split plan fills: 0 where programs do not run in parallel
    (CPU tensors, the interpreter), which plans no split."""
    if device.type != "cuda" or _interpreted():
        return 0
    return _sm_count(device.index or 0)


def launch_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    window: int = 0,
    num_splits: int | None = None,
    tile: Tile | None = None,
    sms: int | None = None,
) -> LaunchPlan:
    """How ``decode_attention`` will launch for these inputs (the benchmark reports it).
    ``sms``: the multiprocessors to fill, by default ``device_sms`` of q's device."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    dtype, quantized = _dot_dtype(q, k_cache), kv_quant.is_quantized(k_cache)
    tile = tile or decode_tile(dtype, q.shape[-1], group, k_cache.shape[1], window, quantized)
    head_tiles = triton.cdiv(group, tile.rows)
    if num_splits is None:
        sms = device_sms(q.device) if sms is None else sms
        num_splits = 1
        if sms > 0:
            max_context = block_tables.shape[1] * k_cache.shape[1]
            if window > 0:
                max_context = min(max_context, window)
            programs = q.shape[0] * num_kv_heads * head_tiles
            num_splits = choose_num_splits(programs, max_context, sms)
    return LaunchPlan(tile, head_tiles, num_splits)


def decode_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    *,
    num_splits: int | None = None,
    tile: Tile | None = None,
    sms: int | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``decode_attention`` (not yet written) and the launches that fill it,
    and with ``scores`` the one that adds to them (``_decode_scores_launch``). Over a rotated
    format (``kv_quant.rotated``), q is rotated (``rotated_query``) and the output is too, in
    float32 (``rotated_output``)."""
    batch, num_heads, dk = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    dv = kv_quant.value_dim(v_cache)
    out = torch.empty(batch, num_heads, dv, dtype=_out_dtype(q, v_cache), device=q.device)
    if batch == 0:
        return out, []
    block_tables = _rows_contiguous(block_tables)
    plan = launch_plan(q, k_cache, v_cache, block_tables, window, num_splits, tile, sms)
    num_splits, tile = plan.num_splits, plan.tile
    # Partial results are fp32 even when unused (one split), so the pointer types, and with
    # them the compiled variant, do not depend on the split count. The log-sum-exps are
    # always written.
    lse_parts = batch * num_heads * num_splits
    parts = lse_parts if num_splits > 1 else 0
    part_out = torch.empty(parts, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(lse_parts, dtype=torch.float32, device=q.device)
    dims = _dims(dk, dv)
    grid = (batch, num_kv_heads * plan.head_tiles, num_splits)
    k_view, v_view = _kernel_view(k_cache), _kernel_view(v_cache)
    args = (
        q, k_view, v_view, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, window, block_tables.shape[1], num_heads, num_splits,
        *q.stride(), *k_view.stride(), *v_view.stride(), block_tables.stride(0), *out.stride(),
    )  # fmt: skip
    params = dict(
        GROUP=num_heads // num_kv_heads, HEAD_TILES=plan.head_tiles, BS=block_size,
        WINDOWED=window > 0, SHARED_V=_v_is_k_prefix(k_cache, v_cache, dims["D1"]),
        BLOCK_G=tile.rows, BLOCK_N=tile.block_n, **dims, **_precision(_dot_dtype(q, k_cache)),
        **_format_params(k_cache, v_cache), num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    launches = [Launch(_decode_kernel, grid, args, params)]
    if num_splits > 1:
        args = (part_out, part_lse, out, num_heads, num_splits, *out.stride())
        block_s = max(1, MERGE_VALUES // dims["BLOCK_DV"])
        params = dict(DV=dv, MAX_S=MAX_SPLITS, BLOCK_S=block_s, BLOCK_DV=dims["BLOCK_DV"])
        launches.append(Launch(_merge_kernel, (batch, num_heads), args, params))
    if scores is not None:
        assert window == 0, "a sliding-window group keeps no scores"
        launches.append(_decode_scores_launch(
            q, k_cache, block_tables, seq_lens, scale, plan, part_lse, scores, score_from
        ))  # fmt: skip
    return out, launches


def _decode_scores_launch(
    q, k_cache, block_tables, seq_lens, scale, plan: LaunchPlan, part_lse, scores, score_from
) -> Launch:
    """``_decode_scores_kernel`` on the decode's grid and splits, reading the log-sum-exps
    the decode kernel stores in ``part_lse``: each counted query adds its attention to
    ``scores`` [N, bs, Hkv] (``reference.decode_attention``)."""
    batch, num_heads, dk = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert scores.shape == (k_cache.shape[0], block_size, num_kv_heads), scores.shape
    d1, d2 = _split_head_dim(dk)
    k_view = _kernel_view(k_cache)
    args = (
        q, k_view, block_tables, seq_lens, score_from, part_lse, scores, scale * _LOG2E,
        num_heads, plan.num_splits, *q.stride(), *k_view.stride(), block_tables.stride(0),
        *scores.stride(),
    )  # fmt: skip
    params = dict(
        GROUP=num_heads // num_kv_heads, HEAD_TILES=plan.head_tiles, BS=block_size, D1=d1,
        D2=d2, BLOCK_G=plan.tile.rows, BLOCK_N=plan.tile.block_n, BLOCK_D1=_pow2(d1),
        BLOCK_D2=_pow2(d2), BLOCK_S=SCORE_SPLITS, **_precision(_dot_dtype(q, k_cache)),
        **_format_params(k_cache), num_warps=plan.tile.num_warps,
        num_stages=plan.tile.num_stages,
    )  # fmt: skip
    grid = (batch, num_kv_heads * plan.head_tiles, plan.num_splits)
    return Launch(_decode_scores_kernel, grid, args, params)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    *,
    num_splits: int | None = None,
    tile: Tile | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (already written to the cache) -> [B, Hq, Dv].

    Grid: (B, KV heads x head tiles, splits); see ``launch_plan``. ``num_splits`` and ``tile``
    override the defaults (tests force split-K on and off; the benchmark sweeps tiles).
    ``scores`` and ``score_from`` as in ``reference.decode_attention`` (no window).
    """
    out, launches = decode_launches(
        rotated_query(q, k_cache), k_cache, v_cache, block_tables, seq_lens, scale, window,
        num_splits=num_splits, tile=tile, scores=scores, score_from=score_from,
    )  # fmt: skip
    run(launches)
    return rotated_output(out, v_cache, q.dtype)


def prefill_launches(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    *,
    tile: Tile | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``prefill_attention`` (not yet written) and the launches that fill it:
    those that quantize the chunk's keys and values as the cache would (``read_back_launches``),
    then the attention, and with ``scores`` the launch that adds to them. Over a rotated
    format, q is rotated and the output is too, as in ``decode_launches``."""
    block_tables = _rows_contiguous(block_tables)
    num_tokens, num_heads, dk = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    dv = kv_quant.value_dim(v_cache)
    out = torch.empty(num_tokens, num_heads, dv, dtype=_out_dtype(q, v_cache), device=q.device)
    batch = prefix_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out, []
    k, v, launches = read_back_launches(k, v, k_cache, v_cache)
    group = num_heads // num_kv_heads
    dims = _dims(dk, dv)
    dtype = _dot_dtype(q, k_cache)
    tile = tile or prefill_tile(dtype, dk, dv, group, kv_quant.is_quantized(k_cache))
    block_g = min(triton.next_power_of_2(group), tile.rows)
    block_q = tile.rows // block_g
    head_tiles = triton.cdiv(group, block_g)
    grid = (num_tokens // block_q + batch, num_kv_heads * head_tiles)
    views = [_kernel_view(t) for t in (k, v, k_cache, v_cache)]
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    args = (
        q, *views, block_tables, cu_seqlens_q, prefix_lens, out, lse,
        scale * _LOG2E, window, block_tables.shape[1], batch, num_heads,
        *q.stride(), *(stride for t in views for stride in t.stride()),
        block_tables.stride(0), *out.stride(),
    )  # fmt: skip
    params = dict(
        GROUP=group, HEAD_TILES=head_tiles, BS=block_size, WINDOWED=window > 0,
        SHARED_V=_v_is_k_prefix(k_cache, v_cache, dims["D1"]),
        SHARED_V_NEW=_v_is_k_prefix(k, v, dims["D1"]),
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_SEQS=SEQS_PER_PASS, BLOCK_N=tile.block_n,
        **dims, **_precision(dtype), **_format_params(k_cache, v_cache, k, v),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    launches.append(Launch(_prefill_kernel, grid, args, params))
    if scores is not None:
        # The same grid and tile, over the keys only, at most 32 a step (64 of int4, unpacked
        # beside 64 rows of queries, spill on sm_80).
        assert window == 0, "a sliding-window group keeps no scores"
        assert scores.shape == (k_cache.shape[0], block_size, num_kv_heads), scores.shape
        k_new, k_cached = views[0], views[2]
        args = (
            q, k_new, k_cached, block_tables, cu_seqlens_q, prefix_lens, score_from, lse, scores,
            scale * _LOG2E, batch, num_heads, *q.stride(), *k_new.stride(), *k_cached.stride(),
            block_tables.stride(0), *scores.stride(),
        )  # fmt: skip
        values = ("WINDOWED", "SHARED_V", "SHARED_V_NEW", "DV", "BLOCK_DV")
        params = {name: p for name, p in params.items() if name not in values}
        params["BLOCK_N"] = min(tile.block_n, 32)
        # Two stages (the next key tile in flight still): with three, MLA's fp32 variant keeps
        # an 8-byte stack frame under the ptxas of triton 3.6 (the GPU image's).
        params["num_stages"] = 2
        launches.append(Launch(_prefill_scores_kernel, grid, args, params))
    return out, launches


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    *,
    tile: Tile | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks of new tokens attending causally to themselves and to their cached prefix.

    Grid: (query tiles of all sequences, KV heads x head tiles). A program takes BLOCK_Q tokens
    times BLOCK_G query heads of one KV head as its rows, walks the cached prefix through the
    block table, then the chunk's own keys up to its last row (and, with ``scores``, walks
    them again: ``reference.prefill_attention``'s scores, no window).
    """
    out, launches = prefill_launches(
        rotated_query(q, k_cache), k, v, k_cache, v_cache, block_tables, cu_seqlens_q,
        prefix_lens, scale, window, tile=tile, scores=scores, score_from=score_from,
    )  # fmt: skip
    run(launches)
    return rotated_output(out, v_cache, q.dtype)
