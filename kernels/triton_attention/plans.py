"""Launch shapes: tiles (``decode_tile``, ``prefill_tile``), key widths and precision, and the
decode split plan (``launch_plan``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels import kv_quant
from kernels.triton_attention.decode import _decode_kernel
from kernels.triton_attention.formats import _dot_dtype


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


def tile_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.dtype:
    """The cache dtype a tile is sized for: int4's where either half is int4 (its tiles are
    unpacked in registers, and take fewer of them), else the keys'."""
    return torch.uint8 if torch.uint8 in (k_cache.dtype, v_cache.dtype) else k_cache.dtype


def _dims(dk: int, dv: int) -> dict:
    d1, d2 = _split_head_dim(dk)
    return dict(D1=d1, D2=d2, DV=dv, BLOCK_D1=_pow2(d1), BLOCK_D2=_pow2(d2), BLOCK_DV=_pow2(dv))


def decode_tile(
    dtype: torch.dtype,
    dk: int,
    group: int,
    block_size: int = 16,
    window: int = 0,
    kv: torch.dtype | None = None,
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

    ``kv`` is the cache's dtype. A quantized cache's tiles (``dtype`` is then the model's) are
    converted in registers: from 256 wide on they take 8 warps (head dim 256 on 4 spills on both
    targets), MLA's 32 heads and 16 keys a step (64 heads spill hundreds of bytes). int4's
    tiles, unpacked in registers, take less: 16 MLA heads (32 spill 400 bytes under triton
    3.6), and 8 warps where 128 wide (4 spill on sm_90)."""
    rows, width = min(_pow2(group), 64), _pow2(dk)
    quantized = kv in kv_quant.QUANTIZED
    if dtype == torch.float32:
        return Tile(min(rows, 32), 32 if width <= 128 else 16, 4 if width <= 64 else 8, 3)
    if quantized and width > 256:
        return Tile(min(rows, 16 if kv == torch.uint8 else 32), 16, 8, 3)
    if quantized and width == 256:
        return Tile(rows, 32, 8, 3)
    if kv == torch.uint8 and width == 128:
        return Tile(rows, 64, 8, 3)
    if width > 256:
        if rows > 32 and block_size % 16 == 0 and window == 0:
            return Tile(rows, 16, 8, 3)
        return Tile(min(rows, 32), 32, 8, 3)
    return Tile(rows, 64 if width <= 128 else 32, 4, 3)


def prefill_tile(
    dtype: torch.dtype,
    dk: int,
    dv: int,
    group: int = 1,
    kv: torch.dtype | None = None,
    shifted: bool = False,
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

    Over a quantized cache (``kv``: the cache's dtype) MLA takes 16 rows, 32 keys a step (int4: 16):
    its tiles are converted in registers, and wider ones spill on sm_90. Other widths keep
    their tiles. A shifted prefill (``SHIFT``: older keys beside recent rows) masks its cached
    prefix per row too: at head dim 256 its 32 rows spill 8 bytes under triton 3.6 on sm_90,
    so it takes 16."""
    width = max(_pow2(dk), _pow2(dv))
    if dtype == torch.float32:
        if width == 256:
            return Tile(16, 16, 4, 3)
        return Tile(32, 16, 4 if width <= 64 else 8, 3)
    if kv in kv_quant.QUANTIZED and width > 256:
        return Tile(16, 16 if kv == torch.uint8 else 32, 8, 3)
    if width <= 64:
        return Tile(64, 64, 4)
    if width <= 128:
        return Tile(64, 32, 8, 3)
    if width == 256:
        return Tile(16 if shifted else 32, 16, 8)
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
    dtype = _dot_dtype(q, k_cache)
    kv = tile_kv(k_cache, v_cache)
    tile = tile or decode_tile(dtype, q.shape[-1], group, k_cache.shape[1], window, kv)
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
