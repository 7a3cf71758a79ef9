"""Triton kernels over weights stored in GGUF block formats (``kernels.weights``).

A weight stays in its file's blocks; the kernels dequantize each element where they read it:

  - ``_quant_matmul_kernel``: a step of many rows. A program computes a [BLOCK_M, BLOCK_N] tile
    of y = x W^T, dequantizing a [BLOCK_N, BLOCK_K] tile of W per step of K and multiplying it
    against the activations with ``tl.dot`` into an fp32 accumulator.
  - ``_quant_gemv_kernel``: a decode step of up to ``GEMV_ROWS`` rows. A program owns
    BLOCK_N output features and streams their blocks once, for all rows at once; no dot units
    (a 1-row product would waste 15/16 of a 16-row MMA, and the weight's bytes bound it anyway).
    q4_k and q6_k are read in their blocks' own order (``_gemv_q4_k``, ``_gemv_q6_k``), the
    activations gathered to match: q4_k's quants then come in 16-byte loads.
  - ``_dequantize_rows_kernel``: rows of an embedding table, looked up by id.

Element k of a stored row lies in block ``k // QK`` at byte ``(k // QK) * BLOCK_BYTES``;
``_dequantize`` unpacks element-wise, for every format from one body (a branch per format, on
the GGML type id), in the arithmetic of gguf-py's dequantizers (``kernels.quant.dequantize``)
so that rows come out bit for bit the same. ``dense`` parts are plain float rows.

``TritonQuantLinear`` and ``TritonQuantEmbedding`` are the modules of ``kernels.quant`` on these
kernels, over the same buffers; ``swap_modules`` puts them in a model (``TritonBackend.prepare``).

A matrix is a tuple of parts stacked by output rows (``kernels.weights.Parts``); each part is
one launch writing its own columns of y, so parts of different formats need no conversion.
The matmul's weights enter its dot rounded to the activations' dtype, as in
``QuantLinear.forward``; the GEMV multiplies them in fp32 as dequantized (rounding each value to
16 bits and back would cost two of its ~7 instructions a value, and it is instruction-bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from kernels.launch import Launch, run
from kernels.quant import QuantEmbedding, QuantLinear
from kernels.weights import FORMATS, Parts, Weight


@triton.jit
def _dequantize(
    w_ptr,
    row_off,
    row_ok,
    k0,
    K,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K]: elements [k0, k0 + BLOCK_K) of the rows at ``w_ptr + row_off``
    (``row_off`` [BLOCK_N, 1]); 0 past K and where ``row_ok`` is False. Offsets are int32
    from a base the caller moves to its tile: 64-bit addresses per element would hold twice
    the registers. k0 is a multiple of BLOCK_K, a multiple of 32; K is one of the block size.

    The tile is taken as [BLOCK_N, granules, G], a granule being the G values that share a
    scale (16 in q6_k, 32 elsewhere): scales and minimums are loaded once per granule, only the
    quants per value. Byte layouts (ggml-common.h), offsets within a block:
      q4_0  d@0 qs@2[16]            q4_1  d@0 m@2 qs@4[16]
      q5_0  d@0 qh@2[4] qs@6[16]    q5_1  d@0 m@2 qh@4[4] qs@8[16]
      q8_0  d@0 qs@2[32] (int8)
      q4_k  d@0 dmin@2 scales@4[12] qs@16[128]
      q5_k  d@0 dmin@2 scales@4[12] qh@16[32] qs@48[128]
      q6_k  ql@0[128] qh@128[64] scales@192[16] (int8) d@208
    """
    # if / else, not an early return: Triton 3.6 compiles the statements after a return in a
    # constexpr branch too, and the block formats' byte loads do not compile on floats.
    if FMT == 0:  # dense: the row is the values
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        w = tl.load(w_ptr + (row_off + k), mask=row_ok & (k < K), other=0.0).to(tl.float32)
    else:
        G: tl.constexpr = 16 if FMT == 14 else 32
        S: tl.constexpr = BLOCK_K // G
        g = k0 // G + tl.arange(0, S)[None, :, None]  # granule of the row: [1, S, 1]
        lane = tl.arange(0, G)[None, None, :]  # value within the granule: [1, 1, G]
        ok = row_ok[:, :, None] & (g < K // G)  # [BLOCK_N, S, 1]
        blk = row_off[:, :, None] + (g * G // QK) * BLOCK_BYTES  # the granule's block
        i0 = g * G % QK  # the granule's first value within its block
        D_AT: tl.constexpr = 208 if FMT == 14 else 0
        d = tl.load((w_ptr + (blk + D_AT)).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        d = d.to(tl.float32)
        # 32-value blocks: value l is nibble l // 16 of quant byte l % 16.
        nibble = 4 * (lane // 16)
        if FMT == 2:  # q4_0
            q = tl.load(w_ptr + (blk + 2 + lane % 16), mask=ok, other=0).to(tl.int32)
            q = (q >> nibble) & 15
            w = d * (q - 8).to(tl.float32)
        elif FMT == 3:  # q4_1
            m = tl.load((w_ptr + (blk + 2)).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
            q = tl.load(w_ptr + (blk + 4 + lane % 16), mask=ok, other=0).to(tl.int32)
            q = (q >> nibble) & 15
            w = d * q.to(tl.float32) + m.to(tl.float32)
        elif FMT == 6 or FMT == 7:  # q5_0, q5_1: bit l of the 32-bit qh is value l's fifth bit
            QH_AT: tl.constexpr = 2 if FMT == 6 else 4
            hb = tl.load(w_ptr + (blk + QH_AT + lane // 8), mask=ok, other=0).to(tl.int32)
            lo = tl.load(w_ptr + (blk + QH_AT + 4 + lane % 16), mask=ok, other=0).to(tl.int32)
            q = ((lo >> nibble) & 15) | (((hb >> (lane % 8)) & 1) << 4)
            if FMT == 6:
                w = d * (q - 16).to(tl.float32)
            else:
                m = tl.load((w_ptr + (blk + 2)).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
                w = d * q.to(tl.float32) + m.to(tl.float32)
        elif FMT == 8:  # q8_0
            q = tl.load(w_ptr + (blk + 2 + lane), mask=ok, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d
        elif FMT == 12 or FMT == 13:  # q4_k, q5_k: 8 sub-blocks of 32, a 6-bit scale and min each
            s = i0 // 32
            j = s % 4
            # scales[12] as three rows of 4 (gguf-py's get_scale_min): sub-block s < 4 takes the
            # low 6 bits of rows 0 and 1; s >= 4 the nibbles of row 2 and the top bits of rows 0, 1.
            a = tl.load(w_ptr + (blk + 4 + j), mask=ok, other=0).to(tl.int32)
            b = tl.load(w_ptr + (blk + 8 + j), mask=ok, other=0).to(tl.int32)
            c = tl.load(w_ptr + (blk + 12 + j), mask=ok, other=0).to(tl.int32)
            sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 2) & 48)).to(tl.float32)
            mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 2) & 48)).to(tl.float32)
            dmin = tl.load((w_ptr + (blk + 2)).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
            # Sub-blocks 2t and 2t + 1 are the low and high nibbles of the same 32 bytes.
            QS_AT: tl.constexpr = 16 if FMT == 12 else 48
            q = tl.load(w_ptr + (blk + QS_AT + (s // 2) * 32 + lane), mask=ok, other=0).to(tl.int32)
            q = (q >> (4 * (s % 2))) & 15
            if FMT == 13:  # the fifth bit of sub-block s is bit s of qh[value]
                hb = tl.load(w_ptr + (blk + 16 + lane), mask=ok, other=0).to(tl.int32)
                q |= ((hb >> s) & 1) << 4
            w = (d * sc) * q.to(tl.float32) - dmin.to(tl.float32) * mn
        else:  # q6_k (14): two halves of 128; quarter r of a half: a ql nibble, 2 bits of qh
            r = i0 % 128 // 32
            at = i0 % 32 + lane
            ql_at = blk + i0 // 128 * 64 + r % 2 * 32 + at
            lo = tl.load(w_ptr + ql_at, mask=ok, other=0).to(tl.int32)
            hi = tl.load(w_ptr + (blk + 128 + i0 // 128 * 32 + at), mask=ok, other=0).to(tl.int32)
            q = ((lo >> (4 * (r // 2))) & 15) | (((hi >> (2 * r)) & 3) << 4)
            sc = tl.load(w_ptr + (blk + 192 + i0 // 16), mask=ok, other=0).to(tl.int8, bitcast=True)
            w = (d * sc.to(tl.float32)) * (q - 32).to(tl.float32)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return w


# Row counts (and with them the strides of x and y) change from step to step; they are not
# specialized on, so that every step of a matrix launches the variant its first step compiled.
_NOT_SPECIALIZED = ["M", "stride_xm", "stride_om"]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)[:, None]
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_tile = x_ptr + m0.to(tl.int64) * stride_xm
    w_tile = w_ptr + n0.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_tile + (rm * stride_xm + k), mask=(m0 + rm < M) & (k < K), other=0.0)
        w = _dequantize(
            w_tile, rn * stride_wn, n0 + rn < N, k0, K, FMT, QK, BLOCK_BYTES, BLOCK_N, BLOCK_K
        )
        w = w.to(x_ptr.dtype.element_ty)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    cols = n0 + tl.arange(0, BLOCK_N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rows = m0 + rm
    out = out_ptr + rows.to(tl.int64) * stride_om + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M) & (cols < N))


@triton.jit
def _gemv_q4_k(x_rows, x_ok, w_rows, row_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """q4_k's part of a GEMV, [BLOCK_M, BLOCK_N] sums, in the blocks' own order: chunk t of a
    block is quant bytes [32 t, 32 t + 32), whose low nibbles are values 64 t + l and high
    nibbles 64 t + 32 + l (sub-blocks 2 t and 2 t + 1). Each chunk's 32 bytes are one
    16-byte-aligned run (blocks of 144 bytes, quants at 16), read as wide loads; the
    activations are gathered in the same order instead of the weights reordered."""
    C: tl.constexpr = BLOCK_K // 64
    chunk = tl.arange(0, C)[None, :, None]  # [1, C, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    word = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([x_rows.shape[0], BLOCK_N, C, 32], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ch = k0 // 64 + chunk
        ok = row_ok[:, :, None] & (ch < K // 64)  # [BLOCK_N, C, 1]
        blk = w_rows[:, :, None] + (ch // 4) * 144
        t = ch % 4
        q = tl.load(blk + (16 + 32 * t + lane), mask=ok, other=0).to(tl.int32)
        # d, dmin and scales[12] as four 32-bit words (the block is 16-byte aligned).
        head = tl.load(blk.to(tl.pointer_type(tl.int32)) + word, mask=ok, other=0)
        dd = tl.sum(tl.where(word == 0, head, 0), axis=2, keep_dims=True)
        rows0 = tl.sum(tl.where(word == 1, head, 0), axis=2, keep_dims=True)
        rows1 = tl.sum(tl.where(word == 2, head, 0), axis=2, keep_dims=True)
        rows2 = tl.sum(tl.where(word == 3, head, 0), axis=2, keep_dims=True)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        # The 6-bit scale and min of sub-block s from scales[12] as three rows of 4 (gguf-py's
        # get_scale_min): s < 4 takes the low 6 bits of column s % 4 of rows 0 and 1; s >= 4
        # the nibbles of row 2 and the top bits of rows 0 and 1. The low nibbles are sub-block
        # 2 t, in column (2 t) % 4; the high ones 2 t + 1, in the next column.
        col = 8 * ((2 * t) % 4)  # the low sub-block's byte in each row's word
        a0, a1 = (rows0 >> col) & 255, (rows0 >> (col + 8)) & 255
        b0, b1 = (rows1 >> col) & 255, (rows1 >> (col + 8)) & 255
        c0, c1 = (rows2 >> col) & 255, (rows2 >> (col + 8)) & 255
        low = t < 2
        sc0 = tl.where(low, a0 & 63, (c0 & 15) | ((a0 >> 2) & 48)).to(tl.float32)
        mn0 = tl.where(low, b0 & 63, (c0 >> 4) | ((b0 >> 2) & 48)).to(tl.float32)
        sc1 = tl.where(low, a1 & 63, (c1 & 15) | ((a1 >> 2) & 48)).to(tl.float32)
        mn1 = tl.where(low, b1 & 63, (c1 >> 4) | ((b1 >> 2) & 48)).to(tl.float32)
        w0 = (d * sc0) * (q & 15).to(tl.float32) - dmin * mn0
        w1 = (d * sc1) * (q >> 4).to(tl.float32) - dmin * mn1
        at = (ch * 64 + lane)[None]  # the low nibbles' values: [1, 1, C, 32]
        x_at = x_rows + at
        x_in = x_ok & (at < K)
        x0 = tl.load(x_at, mask=x_in, other=0.0)
        x1 = tl.load(x_at + 32, mask=x_in, other=0.0)
        acc += x0.to(tl.float32) * w0[None] + x1.to(tl.float32) * w1[None]
    return tl.sum(tl.sum(acc, axis=3), axis=2)


@triton.jit
def _gemv_q6_k(x_rows, x_ok, w_rows, row_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """q6_k's part of a GEMV in the blocks' own order: chunk (h, g) of a block (h a half of
    128 values, g in 0, 1) is ql bytes [64 h + 32 g, +32), whose low nibbles are quarter g of
    the half and high nibbles quarter g + 2, the two high bits of each in qh[32 h + l]; a
    value's scale is per 16 values, so a chunk is taken as [2, 16]."""
    C: tl.constexpr = BLOCK_K // 64
    chunk = tl.arange(0, C)[None, :, None, None]  # [1, C, 1, 1]
    u = tl.arange(0, 2)[None, None, :, None]  # which 16 of the chunk's 32
    v = tl.arange(0, 16)[None, None, None, :]
    acc = tl.zeros([x_rows.shape[0], BLOCK_N, C, 2, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ch = k0 // 64 + chunk
        ok = row_ok[:, :, None, None] & (ch < K // 64)  # [BLOCK_N, C, 1, 1]
        blk = w_rows[:, :, None, None] + (ch // 4) * 210
        h = ch % 4 // 2
        g = ch % 2
        lo = tl.load(blk + (32 * (ch % 4) + 16 * u + v), mask=ok, other=0).to(tl.int32)
        hi = tl.load(blk + (128 + 32 * h + 16 * u + v), mask=ok, other=0).to(tl.int32)
        d = tl.load((blk + 208).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        d = d.to(tl.float32)
        sc_at = blk + (192 + 8 * h + 2 * g + u)  # quarter g's scales; quarter g + 2's at +4
        sc0 = tl.load(sc_at, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc1 = tl.load(sc_at + 4, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        q0 = (lo & 15) | (((hi >> (2 * g)) & 3) << 4)
        q1 = (lo >> 4) | (((hi >> (2 * g + 4)) & 3) << 4)
        w0 = (d * sc0) * (q0 - 32).to(tl.float32)
        w1 = (d * sc1) * (q1 - 32).to(tl.float32)
        at = (ch // 4 * 256 + 128 * h + 32 * g + 16 * u + v)[None]  # quarter g's values
        x_at = x_rows + at
        x_in = x_ok & (at < K)
        x0 = tl.load(x_at, mask=x_in, other=0.0)
        x1 = tl.load(x_at + 64, mask=x_in, other=0.0)
        acc += x0.to(tl.float32) * w0[None] + x1.to(tl.float32) * w1[None]
    return tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)


@triton.jit
def _gemv_any(
    x_rows,
    x_ok,
    w_tile,
    row_off,
    row_ok,
    K,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Any format's part of a GEMV through ``_dequantize``: [BLOCK_N, BLOCK_K] tiles in the
    values' order (q8_0 and the 32-value formats: each granule's quants are one run already)."""
    rk = tl.arange(0, BLOCK_K)[None, None, :]
    acc = tl.zeros([x_rows.shape[0], BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _dequantize(w_tile, row_off, row_ok, k0, K, FMT, QK, BLOCK_BYTES, BLOCK_N, BLOCK_K)
        k = k0 + rk
        x = tl.load(x_rows + k, mask=x_ok & (k < K), other=0.0)
        acc += x.to(tl.float32) * w[None]
    return tl.sum(acc, axis=2)


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _quant_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A program owns BLOCK_N output features and streams their rows once for all of the step's
    rows (BLOCK_M, the step's row count rounded up to a power of 2). Products accumulate
    element-wise and are summed once at the end: a sum across the lanes per step of K would
    cost a shuffle and barrier round per tile."""
    n0 = tl.program_id(0) * BLOCK_N
    rn = tl.arange(0, BLOCK_N)[:, None]
    row_ok = n0 + rn < N
    w_tile = w_ptr + n0.to(tl.int64) * stride_wn
    # The step's rows of x, on the first axis of a tensor of each helper's rank.
    if FMT == 12:
        rm = tl.arange(0, BLOCK_M)[:, None, None, None]
        x_rows, x_ok = x_ptr + rm * stride_xm, rm < M
        acc = _gemv_q4_k(x_rows, x_ok, w_tile + rn * stride_wn, row_ok, K, BLOCK_N, BLOCK_K)
    elif FMT == 14:
        rm = tl.arange(0, BLOCK_M)[:, None, None, None, None]
        x_rows, x_ok = x_ptr + rm * stride_xm, rm < M
        acc = _gemv_q6_k(x_rows, x_ok, w_tile + rn * stride_wn, row_ok, K, BLOCK_N, BLOCK_K)
    else:
        rm = tl.arange(0, BLOCK_M)[:, None, None]
        x_rows, x_ok = x_ptr + rm * stride_xm, rm < M
        acc = _gemv_any(
            x_rows, x_ok, w_tile, rn * stride_wn, row_ok, K, FMT, QK, BLOCK_BYTES, BLOCK_N, BLOCK_K
        )
    rm2 = tl.arange(0, BLOCK_M)[:, None]
    cols = n0 + tl.arange(0, BLOCK_N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = out_ptr + rm2.to(tl.int64) * stride_om + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm2 < M) & (cols < N))


@triton.jit
def _dequantize_rows_kernel(
    ids_ptr,
    w_ptr,
    out_ptr,
    K,
    stride_wn,
    stride_om,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    w_row = w_ptr + tl.load(ids_ptr + row).to(tl.int64) * stride_wn
    here = tl.zeros([1, 1], dtype=tl.int32)
    w = _dequantize(w_row, here, here == 0, k0, K, FMT, QK, BLOCK_BYTES, 1, BLOCK_K)
    k = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + row.to(tl.int64) * stride_om + k
    tl.store(out, tl.reshape(w, [BLOCK_K]).to(out_ptr.dtype.element_ty), mask=k < K)


@dataclass(frozen=True)
class Tile:
    """One program's work: rows, output features, inputs per step, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2


# Steps of at most GEMV_ROWS rows (decodes) take the GEMV kernel; more take the matmul.
GEMV_ROWS = 4


def gemv_tile(rows: int, n: int, fmt: str) -> Tile:
    """The step's rows rounded up to a power of 2 (1, 2 or 4: a one-row decode multiplies no
    padding), 4 warps. A matrix of 8192 outputs and more has programs enough for every
    multiprocessor at 8 features a program (16 for more rows), and steps of 512 values for one
    row, fewer for more; a narrower one (Qwen2.5's down projection: 1536 outputs of 8960
    values) has fewer programs, each streaming a longer row, and takes steps of 1024 values
    for 1 or 2 rows. Each is the fastest of a sweep on an H200 over Qwen2.5-1.5B's q4_k, q6_k
    and q8_0 matrices (bench/results/gpu-h200-2026-11-28-c), within what keeps every variant
    free of register spills on sm_90: the other formats' dequantization holds more registers
    (q5_0 spills at 1024), so they step 512 values at most, and 4 rows of a narrow matrix 256
    (512, the fastest, spills q6_k's under triton 3.6)."""
    block_m = triton.next_power_of_2(rows)
    if n >= 8192:
        return Tile(block_m, 8 if block_m == 1 else 16, max(128, 512 // block_m), 4)
    if block_m == 4:
        return Tile(block_m, 8, 256, 4)
    return Tile(block_m, 8, 1024 if fmt in ("q4_k", "q6_k", "q8_0") else 512, 4)


ROWS_TILE = 128  # elements a row dequantizer program writes


def matmul_tile(rows: int, dtype: torch.dtype, n: int) -> Tile:
    """16 rows up to 64 (a batch of decodes: more programs over N), 64 above (a prefill: each
    dequantized weight tile serves more rows); 64 x 128 for matrices of 8192 outputs and more,
    which keep the multiprocessors busy with those and read each weight tile for 64 rows (the
    fastest of a sweep at 64 rows on an H200, bench/results/gpu-h200-2026-11-28-c; 16 x 64
    steps of 128 values for the narrower ones). Held free of register spills on sm_90 and sm_80
    by ``tests/kernels/test_kernel_variants.py``: fp32 tiles are narrower (their operands are
    twice as wide, and tf32x3 splits each in two; 64 x 64 spills on sm_80), and the 64-row
    16-bit ones take 8 warps (with 4 they need ~230 registers on sm_90)."""
    if dtype == torch.float32:
        return Tile(16, 32, 64, 4) if rows <= 64 else Tile(64, 32, 32, 4)
    if n >= 8192:
        return Tile(64, 128, 64, 8, 3)
    return Tile(16, 64, 128, 4, 3) if rows <= 64 else Tile(64, 64, 64, 8)


def _interpreted() -> bool:
    return not isinstance(_quant_matmul_kernel, triton.runtime.JITFunction)


def _precision(dtype: torch.dtype) -> dict:
    # fp32 activations keep fp32 accuracy on tensor cores with tf32x3 (three tf32 products;
    # plain fp32 dots run on FMA units and spill at these tiles). The interpreter multiplies
    # in fp32, 16-bit operands as fp32 copies (it multiplies bf16 bit patterns:
    # triton-lang/triton#11584).
    interpreted = _interpreted()
    upcast = dtype != torch.float32 and interpreted
    if dtype == torch.float32:
        return dict(PRECISION="ieee" if interpreted else "tf32x3", UPCAST=False)
    return dict(PRECISION="ieee" if upcast else "tf32", UPCAST=upcast)


def _format_params(w: Weight) -> dict:
    spec = FORMATS[w.format]
    return dict(FMT=spec.type_id, QK=spec.block, BLOCK_BYTES=spec.block_bytes)


def _stored(w: Weight) -> torch.Tensor:
    # The kernels step through a stored row with stride 1 (bytes, or a dense row's values).
    return w.data if w.data.stride(1) == 1 else w.data.contiguous()


def linear_launches(
    x: torch.Tensor, parts: Parts, *, tile: Tile | None = None
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``linear`` (not yet written) and the launches that fill it: one per part,
    each writing its own columns. ``tile`` overrides the default (a sweep compiles several)."""
    k = parts[0].in_features
    assert x.shape[-1] == k and all(p.in_features == k for p in parts), (x.shape, k)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n_total = sum(p.out_features for p in parts)
    out = torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    launches, start = [], 0
    for part in parts:
        n = part.out_features
        data, y = _stored(part), out[:, start : start + n]
        start += n
        if m == 0 or n == 0:
            continue
        has_bias = part.bias is not None
        bias = part.bias if has_bias else y
        args = (x2, data, bias, y, m, n, k, x2.stride(0), data.stride(0), y.stride(0))
        params = dict(**_format_params(part), HAS_BIAS=has_bias)
        if m <= GEMV_ROWS:
            kernel, chosen = _quant_gemv_kernel, tile or gemv_tile(m, n, part.format)
            grid = (triton.cdiv(n, chosen.block_n),)
        else:
            kernel, chosen = _quant_matmul_kernel, tile or matmul_tile(m, x.dtype, n)
            grid = (triton.cdiv(m, chosen.block_m), triton.cdiv(n, chosen.block_n))
            params.update(_precision(x.dtype))
        params.update(
            BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, BLOCK_K=chosen.block_k,
            num_warps=chosen.num_warps, num_stages=chosen.num_stages,
        )  # fmt: skip
        launches.append(Launch(kernel, grid, args, params))
    return out.reshape(*x.shape[:-1], n_total), launches


def linear(x: torch.Tensor, parts: Parts) -> torch.Tensor:
    """y = x W^T + bias over the parts stacked by output rows: x [..., in] -> [..., out]."""
    out, launches = linear_launches(x, parts)
    run(launches)
    return out


def embedding_launches(
    ids: torch.Tensor, weight: Weight, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``embedding`` (not yet written) and the launch that fills it."""
    flat = ids.reshape(-1)
    k = weight.in_features
    out = torch.empty(flat.shape[0], k, dtype=dtype, device=weight.data.device)
    shaped = out.reshape(*ids.shape, k)
    if flat.shape[0] == 0:
        return shaped, []
    data = _stored(weight)
    args = (flat, data, out, k, data.stride(0), out.stride(0))
    # No fused multiply-adds: the rows are the reference's to the bit (q4_1's d * q + m).
    params = dict(**_format_params(weight), BLOCK_K=ROWS_TILE, enable_fp_fusion=False)
    grid = (flat.shape[0], triton.cdiv(k, ROWS_TILE))
    return shaped, [Launch(_dequantize_rows_kernel, grid, args, params)]


def embedding(
    ids: torch.Tensor, weight: Weight, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows ``ids`` of the table ``weight``, dequantized: ids [...] -> [..., in] in ``dtype``."""
    out, launches = embedding_launches(ids, weight, dtype)
    run(launches)
    return out


class TritonQuantLinear(QuantLinear):
    """``QuantLinear`` on ``linear``'s kernels, its launches handed to ``run``."""

    def __init__(self, parts: Parts, run: Callable[[Launch], None] = Launch.__call__):
        super().__init__(parts)
        self._run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, launches = linear_launches(x, self.parts)
        for launch in launches:
            self._run(launch)
        return out


class TritonQuantEmbedding(QuantEmbedding):
    """``QuantEmbedding`` on ``embedding``'s kernel, its launch handed to ``run``."""

    def __init__(
        self,
        weight: Weight,
        dtype: torch.dtype = torch.float32,
        run: Callable[[Launch], None] = Launch.__call__,
    ):
        super().__init__(weight, dtype)
        self._run = run

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, launches = embedding_launches(ids, self.stored, self.dtype)
        for launch in launches:
            self._run(launch)
        return out


# A module's hooks go with it to its replacement: tensor parallelism all-reduces the outputs of
# row-parallel projections in forward hooks (``models.tensor_parallel``).
_HOOKS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)  # fmt: skip


def _kernel_module(module: nn.Module, run: Callable[[Launch], None]) -> nn.Module | None:
    if isinstance(module, (TritonQuantLinear, TritonQuantEmbedding)):
        return None
    if isinstance(module, QuantLinear):
        return TritonQuantLinear(module.parts, run)
    if isinstance(module, QuantEmbedding):
        return TritonQuantEmbedding(module.stored, module.dtype, run)
    return None


def swap_modules(model: nn.Module, run: Callable[[Launch], None] = Launch.__call__) -> int:
    """Every ``QuantLinear`` and ``QuantEmbedding`` of ``model`` becomes its Triton module over
    the same buffers (a tied embedding and LM head stay tied), with its hooks; returns how many
    changed."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _kernel_module(child, run)
            if new is None:
                continue
            for hooks in _HOOKS:
                getattr(new, hooks).update(getattr(child, hooks))
            new.train(child.training)
            setattr(parent, name, new)
            swapped += 1
    return swapped
