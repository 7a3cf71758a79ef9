"""Re-rotating cached keys in place: RoPE by a position delta, for context shifting.

RoPE rotates each pair of key values by ``position * inv_freq``, and rotations compose:
``R(p - d) = R(-d) R(p)``. A key cached at position p therefore moves to position ``p - d`` by
one more rotation of ``-d * inv_freq``, without knowing p or the unrotated key. Models with a
YaRN attention factor scale cos and sin by the same factor at every position; the delta rotation
is a pure rotation, so the factor carried by the cached key is kept as it is.

Which values of a cached row are rotary, and how they pair, is the model's business
(``RopeLayout``, from ``model.cached_key_rope(layer_id)``):

    half-split (NeoX, Llama):  pairs (i, i + D/2)      x = [a0 a1 a2 a3 | b0 b1 b2 b3]
    interleaved (GPT-J, DeepSeek): pairs (2i, 2i + 1)   x = [a0 b0 a1 b1 a2 b2 a3 b3]
    MLA latent row: [ c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim) ], start = kv_lora_rank

The cache is ``[N, bs, H, D]``; whole blocks are rotated (a slot not yet written holds nothing
that will be read before it is written). ``rotate_reference`` in torch, ``rotate_triton`` on
CUDA; the attention backend picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.kv_quant import read_blocks, store_blocks
from kernels.launch import Launch, run

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is only needed on CUDA
    triton = None


@dataclass(frozen=True, eq=False)
class RopeLayout:
    """Where the rotary part of a cached key row lies and how its values pair."""

    inv_freq: torch.Tensor  # [rotary_dim // 2], the frequencies the model rotated with
    start: int = 0  # index of the first rotary value in the row's last dimension
    interleaved: bool = False
    # [H, D] subtracted from every key after its rotation (models.llama center_keys): added
    # back before a re-rotation and taken off again after it.
    offset: torch.Tensor | None = field(default=None, compare=False)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def pair_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.inv_freq.numel()
        i = torch.arange(half)
        if self.interleaved:
            return self.start + 2 * i, self.start + 2 * i + 1
        return self.start + i, self.start + half + i


def delta_cos_sin(layout: RopeLayout, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * inv_freq`` in float64, so that large deltas lose nothing."""
    angle = delta * layout.inv_freq.double().cpu()
    return angle.cos(), angle.sin()


def rotate_reference(
    cache: torch.Tensor, blocks: torch.Tensor, delta: int, layout: RopeLayout
) -> None:
    """Rotate the rotary part of every row of ``blocks`` by ``delta`` positions, in place. A
    quantized cache's rows (``kernels.kv_quant``) are dequantized, rotated and stored again."""
    if blocks.numel() == 0 or delta == 0:
        return
    i1, i2 = (i.to(cache.device) for i in layout.pair_indices())
    cos, sin = (t.to(cache.device, torch.float32) for t in delta_cos_sin(layout, delta))
    idx = blocks.to(cache.device, torch.long)
    rows = read_blocks(cache[idx])  # [n, bs, H, D]
    offset = 0 if layout.offset is None else layout.offset.to(rows.device, torch.float32)
    rows += offset
    x1, x2 = rows[..., i1], rows[..., i2]
    rows[..., i1], rows[..., i2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    cache[idx] = store_blocks(rows - offset, cache)


if triton is not None:

    @triton.jit
    def _rotate_kernel(
        cache_ptr,
        blocks_ptr,
        cos_ptr,
        sin_ptr,
        stride_n,
        stride_b,
        stride_h,
        stride_d,
        H: tl.constexpr,
        HALF: tl.constexpr,
        START: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        row = tl.program_id(0)
        block = tl.load(blocks_ptr + row // BS).to(tl.int64)
        base = cache_ptr + block * stride_n + (row % BS) * stride_b
        h = tl.arange(0, BLOCK_H)
        p = tl.arange(0, BLOCK_P)
        if INTERLEAVED:
            d1 = START + 2 * p
            d2 = d1 + 1
        else:
            d1 = START + p
            d2 = d1 + HALF
        mask = (h < H)[:, None] & (p < HALF)[None, :]
        ptr1 = base + h[:, None] * stride_h + d1[None, :] * stride_d
        ptr2 = base + h[:, None] * stride_h + d2[None, :] * stride_d
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + p, mask=p < HALF, other=1.0)[None, :]
        sin = tl.load(sin_ptr + p, mask=p < HALF, other=0.0)[None, :]
        dtype = cache_ptr.dtype.element_ty
        tl.store(ptr1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(ptr2, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rotate_launches(
    cache: torch.Tensor, blocks: torch.Tensor, delta: int, layout: RopeLayout
) -> list[Launch]:
    """What ``rotate_triton`` launches: one program per cache row, all heads of the row at once
    (nothing for no blocks or no move)."""
    if blocks.numel() == 0 or delta == 0:
        return []
    _, block_size, heads, _ = cache.shape
    half = layout.inv_freq.numel()
    cos, sin = (t.to(cache.device, torch.float32) for t in delta_cos_sin(layout, delta))
    blocks = blocks.to(cache.device, torch.int32)
    grid = (blocks.numel() * block_size,)
    params = dict(
        H=heads, HALF=half, START=layout.start, INTERLEAVED=layout.interleaved, BS=block_size,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_P=triton.next_power_of_2(half),
    )  # fmt: skip
    return [Launch(_rotate_kernel, grid, (cache, blocks, cos, sin, *cache.stride()), params)]


def rotate_triton(
    cache: torch.Tensor, blocks: torch.Tensor, delta: int, layout: RopeLayout
) -> None:
    """As ``rotate_reference``, on the GPU."""
    run(rotate_launches(cache, blocks, delta, layout))
