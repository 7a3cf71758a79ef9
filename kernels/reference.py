"""Plain torch paged attention: obviously right, walks the block table. The CPU backend.

Shapes (T new tokens, B sequences, N blocks, bs block size):
  k_cache [N, bs, Hkv, Dk], v_cache [N, bs, Hkv, Dv] (v may be a view of k_cache, as for MLA)
  block_tables int32 [B, W]; seq_lens / prefix_lens int32 [B]
  window > 0: attend to the last ``window`` positions (current one included); the table is a
  ring of width W and position p lives in table[(p // bs) % W].
A cache's dtype names its format (``kernels.kv_quant``): rows are quantized as they are written
and dequantized as they are read, and a prefill chunk's new keys and values are read as the
cache gives them back.

Importance scores (eviction by importance): ``scores`` [N, bs, Hkv] float32 beside a layer's
cache, one per cached token and KV head. When asked (``score_from`` [B]: the first slot whose
query row counts, per sequence), attention adds to each key's score the probability mass the
counted query rows pay it, summed over the query heads of its KV head's group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kernels.kv_quant import (
    CHANNEL_GROUP,
    dequantize,
    dequantize_channels,
    fake_quantize,
    fake_quantize_channels,
    per_channel,
    quantize,
    quantize_channels,
    value_dim,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32; ``offset=1`` for a weight stored as
    w - 1. In half precision the weight multiplies as each architecture's reference does, so
    that greedy choices agree with it where its logits are close: Llama's (offset 0) rounds the
    normalized row to the model's dtype first, Gemma's (offset 1) multiplies in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0:
        return weight.to(x.dtype) * xf.to(x.dtype)
    return (xf * (weight.float() + offset)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    before: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's residual add and the norm after it: ``residual + x`` in the model's
    dtype (``x`` first normalized by the weight ``before`` where given, Gemma's norm after
    each sublayer), and its ``rms_norm``. Returns (normalized, sum)."""
    if before is not None:
        x = rms_norm(x, before, eps, offset)
    total = residual + x
    return rms_norm(total, weight, eps, offset), total


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


def act_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's ``act(gate) * up`` of x [..., 2 * inter] (gate, then up), each operation
    rounded to x's dtype; ``activation`` is a transformers ``hidden_act`` name."""
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position; cos/sin [T, D] in the half-split (rotate_half) layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D / 2]. Rotates pairs (x[2i], x[2i+1]) when ``interleave``
    (DeepSeek's layout), else (x[i], x[i + D/2]); the result is in the half-split layout."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _blocks_and_offsets(
    table: torch.Tensor, positions: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    logical = positions // block_size
    if window > 0:
        logical = logical % table.shape[0]
    return table[logical].long(), positions % block_size


def _positions_to_slots(
    table: torch.Tensor, positions: torch.Tensor, block_size: int, window: int
) -> torch.Tensor:
    blocks, offsets = _blocks_and_offsets(table, positions, block_size, window)
    return blocks * block_size + offsets


def gather_cache(
    cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Rows of ``cache`` ([N, bs, H, R]) at the given positions of one sequence -> [P, H, D],
    dequantized to float32 (int4 keys: read by their whole groups)."""
    positions = positions.to(table.device)
    if per_channel(cache) and positions.numel():
        groups, inverse = torch.unique(positions // CHANNEL_GROUP, return_inverse=True)
        rows = groups[:, None] * CHANNEL_GROUP + torch.arange(CHANNEL_GROUP, device=table.device)
        rows = rows.flatten()
        stored = _rows(cache, table, rows, window).unflatten(0, (-1, CHANNEL_GROUP))
        values = dequantize_channels(stored)
        return values.flatten(0, 1)[inverse * CHANNEL_GROUP + positions % CHANNEL_GROUP]
    return dequantize(_rows(cache, table, positions, window))


def _rows(cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, window: int):
    # Index blocks and offsets directly: flattening a strided view (MLA's value) would copy
    # the whole cache.
    blocks, offsets = _blocks_and_offsets(table, positions, cache.shape[1], window)
    return cache[blocks, offsets]


def write_cache(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``rows`` ([T, H, D]) into ``cache`` ([N, bs, H, R]), in its format; slot -1 is
    skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    flat[slot_mapping] = quantize(rows, cache.dtype)


def _key_groups(k_new, prefix: int, rk_cache, recent_table, recent: int) -> torch.Tensor:
    """One sequence's keys from its first group that new rows ``k_new`` [n, H, D] (at
    ``prefix``..) complete to its last row, as the recent ring holds them: a group is
    quantized from those values, whichever step wrote its rows. The rows before ``prefix``
    from the ring, which holds them until this step writes it."""
    start = prefix - prefix % CHANNEL_GROUP
    head = gather_cache(rk_cache, recent_table, torch.arange(start, prefix), recent)
    return torch.cat([head, k_new.to(rk_cache.dtype).float()])


def _chunk_keys(cache, table, window, new, first, prefix) -> torch.Tensor:
    """A prefill chunk's keys or values at ``first``..: the cached ones as ``cache`` gives them
    back, then its new ones ``new`` (at ``prefix``..) as they are given."""
    cached = gather_cache(cache, table, torch.arange(first, prefix, device=new.device), window)
    return torch.cat([cached, new.float()])


def _grouped_keys(
    k_new, prefix, first, k_cache, table, window, rk_cache, recent_table, recent
) -> torch.Tensor:
    """A prefill chunk's keys at ``first``.. (its new ones ``k_new``, at ``prefix``..) as int4
    groups give them back: the groups cached before the chunk from the cache, the ones it
    completes quantized here (``write_key_groups`` writes them after attention), the last,
    partial one as it is: its rows are within ``recent`` of every row that reads them."""
    rows = _key_groups(k_new, prefix, rk_cache, recent_table, recent)
    full = rows.shape[0] // CHANNEL_GROUP * CHANNEL_GROUP
    rows = torch.cat([fake_quantize_channels(rows[:full]), rows[full:]])
    split = max(first, prefix - prefix % CHANNEL_GROUP)
    cached = gather_cache(k_cache, table, torch.arange(first, split), window)
    return torch.cat([cached, rows[split - (prefix + k_new.shape[0]) :]])


def write_key_groups(
    k_cache: torch.Tensor,
    k: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    rk_cache: torch.Tensor,
    recent_tables: torch.Tensor,
    recent: int,
    window: int = 0,
) -> None:
    """Writes the groups of int4 keys (``kernels.kv_quant``) that a step's new keys k [T, H, D]
    complete, per channel, before the step writes the recent ring that holds their first
    rows. A group not yet complete is not written: attention reads its rows from the ring."""
    bounds = cu_seqlens_q.tolist()
    bs = k_cache.shape[1]
    for i, prefix in enumerate(prefix_lens.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        start = prefix - prefix % CHANNEL_GROUP
        full = (prefix + hi - lo - start) // CHANNEL_GROUP * CHANNEL_GROUP
        if hi == lo or not full:
            continue
        rows = _key_groups(k[lo:hi], prefix, rk_cache, recent_tables[i], recent)[:full]
        groups = quantize_channels(rows.unflatten(0, (-1, CHANNEL_GROUP))).flatten(0, 1)
        pos = torch.arange(start, start + full)
        blocks, offsets = _blocks_and_offsets(block_tables[i], pos, bs, window)
        k_cache[blocks, offsets] = groups


def _attend(q, k, v, scale, mask=None):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, Dv]; fp32 softmax, GQA by grouping heads."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().view(q.shape[0], hkv, group, q.shape[2])
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(q.shape[0], hq, v.shape[2]).to(q.dtype)


def read_back(k, v, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """New keys and values [T, H, D] as the caches give them back once written (MLA's values,
    a prefix of its key rows: the prefix of the keys read back)."""
    if k_cache.dtype == k.dtype:
        return k, v
    k = fake_quantize(k, k_cache.dtype)
    if v_cache.untyped_storage() is k_cache.untyped_storage():
        return k, k[..., : v.shape[-1]]
    return k, fake_quantize(v, v_cache.dtype)


@dataclass(frozen=True)
class GatherPlan:
    """Where each sequence's attended positions live; the same for every layer of a step."""

    blocks: torch.Tensor  # int64 [B, S], physical block of each attended position
    offsets: torch.Tensor  # int64 [B, S], slot within the block
    valid: torch.Tensor  # bool [B, S], False for the padding up to the longest sequence


def gather_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int = 0
) -> GatherPlan:
    """Positions max(0, L - window) .. L - 1 of each sequence, padded to the longest span."""
    lens = seq_lens.long()
    starts = (lens - window).clamp(min=0) if window > 0 else torch.zeros_like(lens)
    span = int((lens - starts).max())
    pos = starts[:, None] + torch.arange(span, device=lens.device)[None, :]  # [B, S]
    valid = pos < lens[:, None]
    pos = torch.where(valid, pos, starts[:, None])  # padding reads a real row, then is masked
    logical = pos // block_size
    if window > 0:
        logical = logical % block_tables.shape[1]
    blocks = torch.gather(block_tables.long(), 1, logical)
    return GatherPlan(blocks, pos % block_size, valid)


def _probs(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """q [..., Hq, D], k [..., Hkv, S, D], mask broadcastable to [..., Hkv, G, S] ->
    softmax probabilities [..., Hkv, G, S] (G query heads per KV head)."""
    hkv = k.shape[-3]
    qg = q.float().unflatten(-2, (hkv, q.shape[-2] // hkv))
    logits = torch.einsum("...hgd,...hsd->...hgs", qg, k.float()) * scale
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def scored_decode(q, k, v, valid, scale, counted):
    """Decode attention that also returns each key's score: q [B, Hq, D], k/v [B, Hkv, S, D],
    valid [B, S], counted [B] (whether the row counts) -> ([B, Hq, Dv], mass [B, S, Hkv])."""
    probs = _probs(q, k, scale, valid[:, None, None, :])  # [B, Hkv, G, S]
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v.float()).flatten(1, 2)
    mass = probs.sum(2).transpose(1, 2) * counted[:, None, None]
    return out.to(q.dtype), mass


def add_scores(scores: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, mass) -> None:
    """``scores[blocks, offsets] += mass`` ([..., H]), where an index repeats too."""
    scores.index_put_((blocks.long(), offsets.long()), mass.to(scores.dtype), accumulate=True)


def clear_scores(scores: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """A slot written with a new token starts with no score (slot -1: none; no host sync, so
    that a CUDA graph may capture it)."""
    flat = scores.view(-1, scores.shape[-1])
    slots = slot_mapping.clamp(min=0)
    flat[slots] = torch.where((slot_mapping >= 0)[:, None], 0.0, flat[slots])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    plan: GatherPlan | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (already written to the cache) -> [B, Hq, Dv].

    Each sequence's context is gathered through its block table, padded to the longest one,
    and the padding masked out of the softmax. ``plan`` (from ``gather_plan``) may be shared
    by all layers of a step. With ``scores`` and ``score_from``, a sequence whose query's slot
    (its length - 1) is at least its ``score_from`` adds its attention to the keys' scores.
    """
    if plan is None:
        plan = gather_plan(block_tables, seq_lens, k_cache.shape[1], window)
    k = dequantize(k_cache[plan.blocks, plan.offsets]).transpose(1, 2)  # [B, Hkv, S, Dk]
    v = dequantize(v_cache[plan.blocks, plan.offsets]).transpose(1, 2)
    if scores is not None:
        counted = (seq_lens.long() - 1 >= score_from.long()).float()
        out, mass = scored_decode(q, k, v, plan.valid, scale, counted)
        add_scores(scores, plan.blocks, plan.offsets, mass * plan.valid[..., None])
        return out
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],
        k,
        v,
        attn_mask=plan.valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :].to(q.dtype)


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
    attend: Callable | None = None,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks of new tokens attending causally to themselves and to their cached prefix.

    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] are the new tokens (read from these tensors,
    not from the cache); sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1], at positions
    prefix_lens[i] + j. The prefix [0, prefix_len) is read through the block table.
    ``attend(q, k, v, scale, mask)`` computes each chunk's attention (default: ``_attend``).
    With ``scores`` and ``score_from``, the rows at or after slot ``score_from[i]`` add their
    attention to the scores of the keys they read, new ones included (full attention only).
    """
    attend = attend or _attend
    k, v = read_back(k, v, k_cache, v_cache)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    bounds = cu_seqlens_q.tolist()
    froms = score_from.tolist() if scores is not None else None
    for i, prefix in enumerate(prefix_lens.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        n = hi - lo
        if n == 0:
            continue
        first = max(0, prefix - window + 1) if window > 0 else 0
        pos_k = torch.arange(first, prefix + n, device=q.device)
        pos_q = torch.arange(prefix, prefix + n, device=q.device)
        cached = torch.arange(first, prefix, device=q.device)
        k_all = torch.cat([gather_cache(k_cache, block_tables[i], cached, window), k[lo:hi]])
        v_all = torch.cat([gather_cache(v_cache, block_tables[i], cached, window), v[lo:hi]])
        k_all, v_all = k_all.to(k.dtype), v_all.to(v.dtype)
        mask = pos_k[None, :] <= pos_q[:, None]
        if window > 0:
            mask &= pos_k[None, :] > pos_q[:, None] - window
        out[lo:hi] = attend(q[lo:hi], k_all, v_all, scale, mask)
        if froms is not None and froms[i] < prefix + n:
            first_row = max(0, froms[i] - prefix)
            _score_chunk(scores, block_tables[i], pos_k, q[lo + first_row : hi], k_all,
                         mask[first_row:], scale)  # fmt: skip
    return out


SCORE_ROWS = 256  # query rows whose probabilities are held at once


def _score_chunk(scores, table, pos_k, q, k_all, mask, scale) -> None:
    """Add the attention of rows ``q`` [R, Hq, D] over keys ``k_all`` [S, Hkv, D] at
    ``pos_k`` (``mask`` [R, S]) to the keys' scores."""
    kt = k_all.transpose(0, 1)  # [Hkv, S, D]
    mass = torch.zeros(kt.shape[0], kt.shape[1], device=q.device)
    for a in range(0, q.shape[0], SCORE_ROWS):
        rows = slice(a, a + SCORE_ROWS)
        mass += _probs(q[rows], kt, scale, mask[rows, None, None, :]).sum(dim=(0, 2))
    blocks, offsets = _blocks_and_offsets(table, pos_k, scores.shape[1], 0)
    add_scores(scores, blocks, offsets, mass.T)


def recent_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rk_cache: torch.Tensor,
    rv_cache: torch.Tensor,
    recent_tables: torch.Tensor,
    recent: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """``decode_attention`` of a layer whose last ``recent`` tokens are also held by the
    caches rk/rv (a ring of that window, through ``recent_tables``): a sequence of length L
    reads positions L - recent .. L - 1 from there and the older ones from k/v."""
    out = torch.empty(*q.shape[:2], value_dim(v_cache), dtype=q.dtype, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        first = max(0, length - window) if window else 0
        split = max(first, length - recent)
        old = torch.arange(first, split, device=q.device)
        new = torch.arange(split, length, device=q.device)
        k = torch.cat([gather_cache(k_cache, block_tables[b], old, window),
                       gather_cache(rk_cache, recent_tables[b], new, recent)])  # fmt: skip
        v = torch.cat([gather_cache(v_cache, block_tables[b], old, window),
                       gather_cache(rv_cache, recent_tables[b], new, recent)])  # fmt: skip
        out[b] = _attend(q[b : b + 1], k, v, scale)[0]
    return out


def recent_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    rk_cache: torch.Tensor,
    rv_cache: torch.Tensor,
    recent_tables: torch.Tensor,
    recent: int,
    scale: float,
    window: int = 0,
    attend: Callable | None = None,
    split: Callable | None = None,
) -> torch.Tensor:
    """``prefill_attention`` of such a layer: the row at position t reads keys and values at
    t - recent < p <= t as the recent caches give them back, and those at p <= t - recent as
    k/v give them back (new ones read back in each cache's format, as a decode would read
    them; int4 keys by their groups, which ``write_key_groups`` writes after this).
    ``attend`` as ``prefill_attention``'s. ``split``: what computes a chunk of a full-attention
    layer instead, as split(q, k_a, v_a, k_b, v_b, prefix, recent, scale) over the older keys
    and values (positions 0 on) and the recent ones (prefix - recent + 1 on, at least 0)."""
    attend = attend or _attend
    channels = per_channel(k_cache)
    if channels:  # keys read back by their groups, per sequence
        k_old, v_old = k, fake_quantize(v, v_cache.dtype)
    else:
        k_old, v_old = read_back(k, v, k_cache, v_cache)
    k_new, v_new = read_back(k, v, rk_cache, rv_cache)
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for i, prefix in enumerate(prefix_lens.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        first = max(0, prefix - window + 1) if window else 0
        recent_first = max(first, prefix - recent + 1)
        pos_q = torch.arange(prefix, prefix + hi - lo, device=q.device)[:, None]
        table, ring_table = block_tables[i], recent_tables[i]
        k_a = (_grouped_keys(k[lo:hi], prefix, first, k_cache, table, window, rk_cache, ring_table,
                             recent) if channels
               else _chunk_keys(k_cache, table, window, k_old[lo:hi], first, prefix))  # fmt: skip
        v_a = _chunk_keys(v_cache, table, window, v_old[lo:hi], first, prefix)
        k_b = _chunk_keys(rk_cache, ring_table, recent, k_new[lo:hi], recent_first, prefix)
        v_b = _chunk_keys(rv_cache, ring_table, recent, v_new[lo:hi], recent_first, prefix)
        if split is not None and not window:
            out[lo:hi] = split(q[lo:hi], k_a.to(k.dtype), v_a.to(v.dtype), k_b.to(k.dtype),
                               v_b.to(v.dtype), prefix, recent, scale)  # fmt: skip
            continue
        pos_a = torch.arange(first, prefix + hi - lo, device=q.device)[None, :]
        pos_b = torch.arange(recent_first, prefix + hi - lo, device=q.device)[None, :]
        mask_a = pos_a <= pos_q - recent
        mask_b = (pos_b <= pos_q) & (pos_b > pos_q - recent)
        if window:
            mask_a &= pos_a > pos_q - window
            mask_b &= pos_b > pos_q - window
        keys, values = torch.cat([k_a, k_b]).to(k.dtype), torch.cat([v_a, v_b]).to(v.dtype)
        out[lo:hi] = attend(q[lo:hi], keys, values, scale, torch.cat([mask_a, mask_b], 1))
    return out
