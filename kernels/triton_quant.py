"""Triton kernels over weights stored in GGUF block formats (``kernels.weights``).

A weight stays in its file's blocks; the kernels dequantize each element where they read it:

  - ``_quant_matmul_kernel``: a step of many rows. A program computes a [BLOCK_M, BLOCK_N] tile
    of y = x W^T, dequantizing a [BLOCK_N, BLOCK_K] tile of W per step of K and multiplying it
    against the activations with ``tl.dot`` into an fp32 accumulator.
  - ``_quant_gemv_kernel``: a decode step of up to ``GEMV_ROWS`` rows. A program owns
    BLOCK_N output features and streams their blocks once, for all rows at once; no dot units
    (a 1-row product would waste 15/16 of a 16-row MMA, and the weight's bytes bound it anyway).
  - ``_dequantize_rows_kernel``: rows of an embedding table, looked up by id.

Element k of a stored row lies in block ``k // QK`` at byte ``(k // QK) * BLOCK_BYTES``;
``_dequantize`` unpacks element-wise, for every format from one body (a branch per format, on
the GGML type id), in the arithmetic of gguf-py's dequantizers (``kernels.quant.dequantize``)
so that rows come out bit for bit the same. ``dense`` parts are plain float rows.

``TritonQuantLinear`` and ``TritonQuantEmbedding`` are the modules of ``kernels.quant`` on these
kernels, over the same buffers; ``swap_modules`` puts them in a model (``TritonBackend.prepare``).

A matrix is a tuple of parts stacked by output rows (``kernels.weights.Parts``); each part is
one launch writing its own columns of y, so parts of different formats need no conversion.
Weights enter the product rounded to the activations' dtype, as in ``QuantLinear.forward``.
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
    n0 = tl.program_id(0) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)[:, None]
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    w_tile = w_ptr + n0.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        w = _dequantize(
            w_tile, rn * stride_wn, n0 + rn < N, k0, K, FMT, QK, BLOCK_BYTES, BLOCK_N, BLOCK_K
        )
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
        x = tl.load(x_ptr + (rm * stride_xm + k), mask=(rm < M) & (k < K), other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    cols = n0 + tl.arange(0, BLOCK_N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = out_ptr + rm.to(tl.int64) * stride_om + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < M) & (cols < N))


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
GEMV_TILE = Tile(GEMV_ROWS, 8, 128, 4)
ROWS_TILE = 128  # elements a row dequantizer program writes


def matmul_tile(rows: int, dtype: torch.dtype) -> Tile:
    """16 rows up to 64 (a batch of decodes: more programs over N), 64 above (a prefill: each
    dequantized weight tile serves more rows). Held free of register spills on sm_90 and sm_80
    by ``tests/kernels/test_kernel_variants.py``: fp32 tiles are narrower (their operands are
    twice as wide, and tf32x3 splits each in two; 64 x 64 spills on sm_80), and the 64-row
    16-bit one takes 8 warps (with 4 it needs ~230 registers on sm_90)."""
    if dtype == torch.float32:
        return Tile(16, 32, 64, 4) if rows <= 64 else Tile(64, 32, 32, 4)
    return Tile(16, 64, 64, 4) if rows <= 64 else Tile(64, 64, 64, 8)


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
            kernel, chosen = _quant_gemv_kernel, tile or GEMV_TILE
            grid = (triton.cdiv(n, chosen.block_n),)
        else:
            kernel, chosen = _quant_matmul_kernel, tile or matmul_tile(m, x.dtype)
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
