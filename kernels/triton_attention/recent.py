"""Attention of a layer whose last tokens are also held by recent rows (``models.kv_spec.
with_recent``), as ``reference.recent_decode_attention`` and ``recent_prefill_attention`` read
them: two attentions over disjoint keys, merged by their log-sum-exps as split-K parts are.

- Recent: the recent rows, a sliding window of ``recent`` tokens (a ring; the layer's own
  window where shorter), float, unrotated.
- Older: the main cache, each row reading the keys at least ``recent`` positions before its own
  (decode: the sequence ``recent`` tokens shorter; prefill: the kernel's ``SHIFT``), its window
  less ``recent``; in the cache's format, rotated query, output rotated back.

``run`` launches a list of ``kernels.launch.Launch`` (the backend's, so a model's launches can be
recorded). The merge and the rotations are torch operations, as decode's rotations are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.launch import Launch
from kernels.triton_attention.formats import rotated_output, rotated_query
from kernels.triton_attention.launches import decode_launches, prefill_launches

Run = Callable[[list[Launch]], None]


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Two normalized attentions of the same rows over disjoint keys, with their log2-sum-exp2s
    [..., H] (-inf: no keys), as one, in float32."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp2(lse_a - top)[..., None], torch.exp2(lse_b - top)[..., None]
    return (out_a.float() * wa + out_b.float() * wb) / (wa + wb)


def _recent_window(window: int, recent: int) -> int:
    """The recent rows' window: ``recent``, or the layer's own where that is shorter."""
    return min(window, recent) if window else recent


def _older_window(window: int, recent: int) -> int | None:
    """The main cache's window counted from ``recent`` tokens back; None: it reads nothing."""
    if window and window <= recent:
        return None
    return window - recent if window else 0


def _two_passes(
    run: Run,
    q: torch.Tensor,
    v_cache: torch.Tensor,
    window: int,
    recent: int,
    recent_pass: Callable,
    older_pass: Callable,
) -> torch.Tensor:
    """``recent_pass(lse)`` and, where the main cache has older keys to give,
    ``older_pass(its window, lse)``: each (output, launches) with its rows' log2-sum-exp2s
    written to ``lse``; run, the older output rotated back, merged."""
    lse_b = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out_b, launches = recent_pass(lse_b)
    run(launches)
    older = _older_window(window, recent)
    if older is None:
        return out_b.to(q.dtype)
    lse_a = torch.empty_like(lse_b)
    out_a, launches = older_pass(older, lse_a)
    run(launches)
    out_a = rotated_output(out_a, v_cache, torch.float32)
    return merge(out_a, lse_a, out_b, lse_b).to(q.dtype)


def recent_decode(
    run: Run,
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    recent_cache: tuple[torch.Tensor, torch.Tensor],
    recent_tables: torch.Tensor,
    recent: int,
    scale: float,
    window: int = 0,
    sms: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (written to both caches) -> [B, Hq, Dv]."""
    k_cache, v_cache = kv_cache
    lens = (seq_lens - recent).clamp(min=0).to(seq_lens.dtype)  # the older keys' sequences
    return _two_passes(
        run, q, v_cache, window, recent,
        lambda lse: decode_launches(
            q, *recent_cache, recent_tables, seq_lens, scale, _recent_window(window, recent),
            sms=sms, lse=lse,
        ),
        lambda older, lse: decode_launches(
            rotated_query(q, k_cache), k_cache, v_cache, block_tables, lens, scale, older,
            sms=sms, lse=lse,
        ),
    )  # fmt: skip


def recent_prefill(
    run: Run,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    recent_cache: tuple[torch.Tensor, torch.Tensor],
    recent_tables: torch.Tensor,
    recent: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Chunks of new tokens (not yet written) over both caches -> [T, Hq, Dv]."""
    k_cache, v_cache = kv_cache
    return _two_passes(
        run, q, v_cache, window, recent,
        lambda lse: prefill_launches(
            q, k, v, *recent_cache, recent_tables, cu_seqlens_q, prefix_lens, scale,
            _recent_window(window, recent), lse=lse,
        ),
        lambda older, lse: prefill_launches(
            rotated_query(q, k_cache), k, v, k_cache, v_cache, block_tables, cu_seqlens_q,
            prefix_lens, scale, older, shift=recent, lse=lse,
        ),
    )  # fmt: skip
