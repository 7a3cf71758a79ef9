"""Cache formats in the kernels (``KV``): their constants, the write kernels (a cache written
in its format, quantized in the kernel), the loaders the attention kernels read quantized rows
with, and the host helpers of the formats (the byte view, ``KV`` and ``ALIGN``, rotations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant

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
        # One float16 store (group starts are even): as two byte stores, the low byte came out
        # 0 on an H200 at 4 warps for rows of 6 groups.
        scale_ptr = (dst + g * _QGROUP_BYTES).to(tl.pointer_type(tl.float16))
        tl.store(scale_ptr, d.to(tl.float16), mask=g_ok)
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
    their row scale (``_row_scale``), int4 dequantized."""
    if KV == _INT4:
        # [rows, groups, 32]: value l of a group is nibble l // 16 of its byte l % 16, so each
        # byte is loaded twice (the second from L1) and the tile comes out in column order. A
        # join of the two nibble halves, reshaped, was miscompiled in 16-bit dots on sm_90.
        g = C0 // _QGROUP + tl.arange(0, BLOCK // _QGROUP)[None, :, None]
        lane = tl.arange(0, _QGROUP)[None, None, :]
        g_ok = valid[:, None, None] & (g < (C0 + C) // _QGROUP)
        group = ptr + row_off[:, None, None] + g * _QGROUP_BYTES
        b = tl.load(group + 2 + lane % (_QGROUP // 2), mask=g_ok, other=0).to(tl.int32)
        scale = tl.load(group.to(tl.pointer_type(tl.float16)), mask=g_ok, other=0.0)
        q = ((b >> (4 * (lane // (_QGROUP // 2)))) & 0xF).to(tl.float32) - 8.0
        x = tl.reshape(q * scale.to(tl.float32), [BLOCK_N, BLOCK]).to(dtype)
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


def _format(cache: torch.Tensor) -> int:
    """The kernels' name for the cache's format (``KV``)."""
    return _FORMATS.get(cache.dtype, _FLOAT.value)


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels read it: a quantized one as bytes."""
    if not kv_quant.is_quantized(cache):
        return cache
    assert cache.stride(-1) == 1, "a quantized cache's rows are contiguous bytes"
    return cache.view(torch.uint8)


def _format_params(k_cache: torch.Tensor, *caches: torch.Tensor, values: bool = True) -> dict:
    """KV (the keys' format), KV_V (the values', ``caches[0]``, where ``values``), and ALIGN:
    the largest power of two up to 16 that every row start of the byte caches divides by
    (their strides but the last), which Triton cannot see in strides that are not multiples
    of 16 (an int8 row of 128 values takes 132 bytes)."""
    caches = (k_cache, *caches)
    align = 16
    for cache in caches:
        if kv_quant.is_quantized(cache):
            for stride in cache.stride()[:-1]:
                while stride % align:
                    align //= 2
    formats = (
        dict(KV=_format(k_cache), KV_V=_format(caches[1])) if values else dict(KV=_format(k_cache))
    )
    return dict(**formats, ALIGN=align)


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
