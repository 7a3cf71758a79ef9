"""The launch code: what writing the cache, decode and prefill launch (``*_launches``, the
launches as data) and the calls that run them (``write_cache``, ``decode_attention``,
``prefill_attention``)."""

from __future__ import annotations

import torch
import triton

from kernels import kv_quant
from kernels.launch import Launch, run
from kernels.triton_attention.decode import (
    _decode_kernel,
    _decode_scores_kernel,
    _merge_kernel,
)
from kernels.triton_attention.formats import (
    _dot_dtype,
    _format,
    _format_params,
    _kernel_view,
    _out_dtype,
    _write_cache_kernel,
    _write_quantized_kernel,
    rotated_output,
    rotated_query,
)
from kernels.triton_attention.plans import (
    MAX_SPLITS,
    MERGE_VALUES,
    SCORE_SPLITS,
    SEQS_PER_PASS,
    LaunchPlan,
    Tile,
    _dims,
    _pow2,
    _precision,
    _rows_contiguous,
    _split_head_dim,
    _v_is_k_prefix,
    launch_plan,
    prefill_tile,
    tile_kv,
)
from kernels.triton_attention.prefill import _prefill_kernel, _prefill_scores_kernel

_LOG2E = 1.4426950408889634


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
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``decode_attention`` (not yet written) and the launches that fill it,
    and with ``scores`` the one that adds to them (``_decode_scores_launch``). Over a rotated
    format (``kv_quant.rotated``), q is rotated (``rotated_query``) and the output is too, in
    float32 (``rotated_output``). ``lse``: float32 [B, Hq] that gets each row's log2-sum-exp2
    of its scores (-inf without keys), in one split."""
    batch, num_heads, dk = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    dv = kv_quant.value_dim(v_cache)
    out = torch.empty(batch, num_heads, dv, dtype=_out_dtype(q, v_cache), device=q.device)
    if batch == 0:
        return out, []
    block_tables = _rows_contiguous(block_tables)
    num_splits = 1 if lse is not None else num_splits
    plan = launch_plan(q, k_cache, v_cache, block_tables, window, num_splits, tile, sms)
    num_splits, tile = plan.num_splits, plan.tile
    # Partial results are fp32 even when unused (one split), so the pointer types, and with
    # them the compiled variant, do not depend on the split count. The log-sum-exps are
    # always written.
    lse_parts = batch * num_heads * num_splits
    parts = lse_parts if num_splits > 1 else 0
    part_out = torch.empty(parts, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(lse_parts, dtype=torch.float32, device=q.device) if lse is None else (
        lse.view(-1))  # fmt: skip
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
        **_format_params(k_cache, values=False), num_warps=plan.tile.num_warps,
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
    shift: int = 0,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output of ``prefill_attention`` (not yet written) and the launches that fill it:
    those that quantize the chunk's keys and values as the cache would (``read_back_launches``),
    then the attention, and with ``scores`` the launch that adds to them. Over a rotated
    format, q is rotated and the output is too, as in ``decode_launches``. ``shift``: each row
    reads keys at least that many positions before its own only (``window`` counted from
    there); ``lse``: float32 [T, Hq] that gets each row's log2-sum-exp2 (as decode's)."""
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
    tile = tile or prefill_tile(dtype, dk, dv, group, tile_kv(k_cache, v_cache), shift > 0)
    block_g = min(triton.next_power_of_2(group), tile.rows)
    block_q = tile.rows // block_g
    head_tiles = triton.cdiv(group, block_g)
    grid = (num_tokens // block_q + batch, num_kv_heads * head_tiles)
    views = [_kernel_view(t) for t in (k, v, k_cache, v_cache)]
    if lse is None:
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
    if shift:
        params["SHIFT"] = shift
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
        values = ("WINDOWED", "SHARED_V", "SHARED_V_NEW", "DV", "BLOCK_DV", "KV_V")
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
