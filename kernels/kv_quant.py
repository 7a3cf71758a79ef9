"""KV-cache storage formats: what a cache tensor's dtype says about its rows, and the torch
reference that writes (quantizes) and reads (dequantizes) them.

A cache is ``[N, bs, H, R]``: per slot and KV head one row of R elements. Its torch dtype names
the format, so that everything that moves whole blocks (copy-on-write, swap, prefix sharing,
tensor parallelism, CUDA graphs) moves scales with their values without knowing of either:

  ==============  =====================  =========================================  ==========
  kv dtype        tensor dtype           a head's row of D values                   R
  ==============  =====================  =========================================  ==========
  float32 ...     float32/bfloat16/f16   the values                                 D
  int8            int8                   float32 scale (4 bytes), D int8            D + 4
  fp8_e4m3        float8_e4m3fn          float32 scale (4 bytes), D e4m3            D + 4
  int4            uint8                  per 32 values: float16 scale, 16 bytes     D / 32 * 18
  ==============  =====================  =========================================  ==========

Each quantized row is first rotated by ``hadamard(D)`` (orthonormal and symmetric, so its own
inverse), which spreads a key's outlier channels over the row: its one scale (int8, fp8) or its
groups' scales (int4) then fit the other values better. Attention may rotate the query (keys)
and the output (values) instead of each cached row: (R q).(R k) = q.k, sum p R v = R sum p v.

int8 and fp8: x = scale * q, the scale the rotated row's largest magnitude over 127 (448 for
e4m3), q = round-half-even(x * inv) (e4m3: x * inv cast to e4m3, saturated), inv = 127 / max
as torch divides a number by a tensor: (1 / max) * 127, rounded twice.

int4: each group of 32 rotated values is stored as llama.cpp's Q4_0 stores a block: d the
signed value of largest magnitude over -8, byte j holding q_j (low nibble) and q_{j+16} (high),
q = min(15, floor(x / d + 8.5)), x = d (q - 8).

The value cache may be a view of the key cache's rows (MLA): a prefix of the row, which in
every format is a whole row of the first values (the scale leads the row, or each group).
"""

from __future__ import annotations

import functools

import torch

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int4": torch.uint8,
}
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.uint8)
GROUP = 32  # int4 values per scale
GROUP_BYTES = 2 + GROUP // 2
SCALE_BYTES = 4  # int8 and fp8
FP8_MAX = 448.0
HADAMARD = 64  # values per rotation block, where the row divides by it (else GROUP)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED


def value_dim(cache: torch.Tensor) -> int:
    """D, the values of one head's row of ``cache`` (any format)."""
    r = cache.shape[-1]
    if cache.dtype == torch.uint8:
        return r // GROUP_BYTES * GROUP
    return r - SCALE_BYTES if cache.dtype in QUANTIZED else r


def rotated(cache: torch.Tensor) -> bool:
    """Whether the format stores rows rotated by ``hadamard``: the quantized ones."""
    return cache.dtype in QUANTIZED


def check_prefix(dtype: torch.dtype, dim: int, prefix: int) -> None:
    """Raises when the first ``prefix`` values of rows of ``dim`` cannot be read as rows of
    their own (MLA's values): their rotation blocks would differ."""
    if dtype == torch.uint8 and hadamard_block(dim) != hadamard_block(prefix):
        raise ValueError(
            f"an int4 cache of rows of {dim} values cannot give their first {prefix} as rows "
            f"(rotation blocks of {hadamard_block(dim)} and {hadamard_block(prefix)})"
        )


def hadamard_block(dim: int) -> int:
    return HADAMARD if dim % HADAMARD == 0 else GROUP


@functools.cache
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    n = hadamard_block(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    block = (h / h.shape[0] ** 0.5).float()
    return torch.block_diag(*[block] * (dim // n)).to(device)


def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[dim, dim] block-diagonal normalized Sylvester Hadamard matrix, blocks of
    ``hadamard_block(dim)`` (a head of 64 or 128 values: blocks of 64; MLA's 576 and its
    value prefix of 512 alike): orthonormal and symmetric."""
    return _hadamard(dim, torch.device(device))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times ``hadamard(D)`` (its own inverse), in float32."""
    return x.float() @ hadamard(x.shape[-1], x.device)


def _scale_bytes(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., 1] float32 -> [..., 4] of ``dtype``, the same bytes."""
    if scale.numel() == 0:  # no rows: nothing to reinterpret (and no strides to do it with)
        return torch.empty(*scale.shape[:-1], SCALE_BYTES, dtype=dtype, device=scale.device)
    flat = scale.float().contiguous().view(torch.uint8)  # [..., 4]
    return flat.reshape(*scale.shape[:-1], SCALE_BYTES).view(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] in the format of cache dtype ``dtype`` -> [..., R]."""
    if dtype not in QUANTIZED:
        return x.to(dtype)
    x = rotate(x)
    if dtype == torch.uint8:
        return _quantize_int4(x)
    amax = x.abs().amax(-1, keepdim=True)
    top = 127.0 if dtype == torch.int8 else FP8_MAX
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    if dtype == torch.int8:
        q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    else:
        q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([_scale_bytes(amax / top, dtype), q], -1)


def _quantize_int4(x: torch.Tensor) -> torch.Tensor:
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    idx = g.abs().argmax(-1, keepdim=True)
    d = torch.gather(g, -1, idx) / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor(g * inv + 8.5).clamp(max=15).to(torch.uint8)
    nibbles = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    scale = d.to(torch.float16).contiguous().view(torch.uint8).reshape(*d.shape[:-1], 2)
    return torch.cat([scale, nibbles], -1).reshape(*x.shape[:-1], g.shape[-2] * GROUP_BYTES)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Rows [..., R] of a cache -> their values [..., D] in float32, rotated back."""
    if rows.dtype not in QUANTIZED:
        return rows.float()
    if rows.dtype == torch.uint8:
        g = rows.reshape(*rows.shape[:-1], rows.shape[-1] // GROUP_BYTES, GROUP_BYTES)
        d = g[..., :2].contiguous().view(torch.float16).float()
        nib = g[..., 2:]
        q = torch.cat([nib & 15, nib >> 4], -1).float() - 8.0
        return rotate((d * q).reshape(*rows.shape[:-1], g.shape[-2] * GROUP))
    scale = rows[..., :SCALE_BYTES].contiguous().view(torch.uint8).view(torch.float32)
    return rotate(rows[..., SCALE_BYTES:].float() * scale)


def fake_quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``dtype`` gives it back: what attention reads once x is written."""
    if x.dtype == dtype:
        return x
    return dequantize(quantize(x, dtype)).to(x.dtype)
