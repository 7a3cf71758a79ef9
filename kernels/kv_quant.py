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
  int4 (keys)     uint8                  D / 2 bytes, a share of its group's codes  D / 32 * 18 + 1
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

int4 keys are quantized per channel (KIVI), not per token: a few key channels carry outliers
that one scale along the head cannot follow. Per head and channel, the 32 tokens of a group
(slots 32g .. 32g + 31 of a block; a block holds whole groups) share a minimum and a scale:
x = lo + s q, q in 0..15. Their codes are 8 bits each, on two float16 grids per head and group
(as Q4_K codes its sub-blocks' scales): lo = lo0 + m dlo, rounded down, and s = c ds, rounded
up, so that no value falls outside its range. The group's ``2 D + 6`` bytes of codes and grid
ends (lo0, dlo, ds, then D codes m, then D codes c) are laid end to end over its 32 rows'
tails, each tail ``ceil((2 D + 6) / 32)`` bytes: a row of 32n values holds 18n + 1 bytes, one
more than a row per token, which is how the format is told apart. No rotation: it would spread
the outlier channels over the others. A group is written once its 32 tokens are there
(``quantize_channels``); until then attention reads them from the recent rows beside the cache
(``models.kv_spec.with_recent``), which int4 keys always keep.

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


CHANNEL_GROUP = 32  # tokens per int4 key group
CHANNEL_GRID_BYTES = 6  # a group's float16 grid ends: lo0, dlo, ds


def channel_tail(dim: int) -> int:
    """Bytes of a group's codes each of its rows of ``dim`` int4 keys holds after its values."""
    return -(-(2 * dim + CHANNEL_GRID_BYTES) // CHANNEL_GROUP)


def per_channel(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds int4 keys per channel: one byte more than a row per token."""
    return cache.dtype == torch.uint8 and cache.shape[-1] % GROUP_BYTES == 1


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED


def value_dim(cache: torch.Tensor) -> int:
    """D, the values of one head's row of ``cache`` (any format)."""
    r = cache.shape[-1]
    if cache.dtype == torch.uint8:
        return r // GROUP_BYTES * GROUP  # per channel too: the extra byte is dropped
    return r - SCALE_BYTES if cache.dtype in QUANTIZED else r


def rotated(cache: torch.Tensor) -> bool:
    """Whether the format stores rows rotated by ``hadamard``: the quantized ones but int4
    keys."""
    return cache.dtype in QUANTIZED and not per_channel(cache)


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


def _half(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x rounded to float16 toward +inf (``up``) or -inf, back in float32."""
    h = x.half()
    off = h.float() < x if up else h.float() > x
    limit = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(h, limit), h).float()


def _channel_grid(x: torch.Tensor):
    """Groups x [..., 32, H, D] -> (lo0, dlo, ds) [..., 1, H, 1] and the codes m, c [..., 1,
    H, D] of their channels' minimums and scales (the module's docstring)."""
    lo, hi = x.amin(-3, keepdim=True), x.amax(-3, keepdim=True)
    lo0 = _half(lo.amin(-1, keepdim=True), up=False)
    dlo = _half((lo.amax(-1, keepdim=True) - lo0) / 255, up=True)
    dlo = torch.where(dlo > 0, dlo, torch.ones_like(dlo))
    m = torch.floor((lo - lo0) / dlo).clamp(0, 255)
    scale = (hi - (lo0 + m * dlo)) / 15
    ds = _half(scale.amax(-1, keepdim=True) / 255, up=True)
    ds = torch.where(ds > 0, ds, torch.ones_like(ds))
    c = torch.ceil(scale / ds).clamp(0, 255)
    return lo0, dlo, ds, m, c


def quantize_channels(x: torch.Tensor) -> torch.Tensor:
    """Groups of int4 keys x [..., 32, H, D] -> their rows [..., 32, H, D / 32 * 18 + 1]."""
    x = x.float()
    lo0, dlo, ds, m, c = _channel_grid(x)
    lo, s = lo0 + m * dlo, c * ds
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round((x - lo) * inv).clamp(0, 15).to(torch.uint8)
    half = GROUP // 2
    g = q.unflatten(-1, (-1, GROUP))
    nibbles = (g[..., :half] | (g[..., half:] << 4)).flatten(-2)
    ends = torch.cat([lo0, dlo, ds], -1).half().view(torch.uint8)  # [..., 1, H, 6]
    codes = torch.cat([ends, m.to(torch.uint8), c.to(torch.uint8)], -1)
    tail = channel_tail(x.shape[-1])
    codes = torch.nn.functional.pad(codes, (0, tail * CHANNEL_GROUP - codes.shape[-1]))
    tails = codes.unflatten(-1, (CHANNEL_GROUP, tail)).movedim(-2, -4).squeeze(-3)
    return torch.cat([nibbles, tails], -1)


def dequantize_channels(rows: torch.Tensor) -> torch.Tensor:
    """Rows of groups of int4 keys [..., 32, H, R] -> their values [..., 32, H, D], float32."""
    dim = value_dim(rows)
    nib = rows[..., : dim // 2].unflatten(-1, (-1, GROUP // 2))
    q = torch.cat([nib & 15, nib >> 4], -1).flatten(-2).float()
    codes = rows[..., dim // 2 :].movedim(-3, -2).flatten(-2)  # [..., H, 32 * tail]
    ends = codes[..., :CHANNEL_GRID_BYTES].contiguous().view(torch.float16).float()
    m = codes[..., CHANNEL_GRID_BYTES : CHANNEL_GRID_BYTES + dim].float()
    c = codes[..., CHANNEL_GRID_BYTES + dim : CHANNEL_GRID_BYTES + 2 * dim].float()
    lo = ends[..., :1] + m * ends[..., 1:2]  # [..., H, D]
    s = c * ends[..., 2:3]
    return lo.unsqueeze(-3) + s.unsqueeze(-3) * q


def read_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks [n, bs, H, R] of a cache -> their values [n, bs, H, D], float32 (rotated
    back)."""
    if per_channel(blocks):
        return dequantize_channels(blocks.unflatten(1, (-1, CHANNEL_GROUP))).flatten(1, 2)
    return dequantize(blocks)


def store_blocks(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Values of whole blocks x [n, bs, H, D] -> their rows in ``cache``'s format."""
    if per_channel(cache):
        return quantize_channels(x.unflatten(1, (-1, CHANNEL_GROUP))).flatten(1, 2)
    return quantize(x, cache.dtype)


def fake_quantize_channels(x: torch.Tensor) -> torch.Tensor:
    """Keys x [..., T, H, D], T a multiple of 32, as int4 groups of 32 give them back."""
    g = x.unflatten(-3, (-1, CHANNEL_GROUP))
    return dequantize_channels(quantize_channels(g)).flatten(-4, -3).to(x.dtype)


def fake_quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``dtype`` gives it back: what attention reads once x is written."""
    if x.dtype == dtype:
        return x
    return dequantize(quantize(x, dtype)).to(x.dtype)
