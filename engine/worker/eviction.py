"""Eviction by importance, the runner's half: which cached tokens a sequence keeps, and moving
them into fewer blocks.

The scheduler decides when and how many (``CacheEviction``); here each layer chooses which, from
the scores of its policy, and the kept rows are compacted into the first ``keep`` slots of the
sequence's new tables. The rows move as stored (any KV dtype), each with its importance score;
kept tokens keep the positions their keys were rotated for, so nothing is re-rotated.

Per policy (one small class each; ``POLICIES``), a score per cached token and KV head, higher
kept first:

- ``snapkv``: the attention the prompt's last ``window`` queries paid each key (then, after an
  eviction, the queries since), accumulated by the attention kernels, averaged over 5
  neighbouring tokens (SnapKV's pooling, so that a kept token keeps its neighbours);
- ``h2o``: the attention every query paid each key (heavy hitters);
- ``knorm``: the key's norm, lowest kept (keys of small norm draw attention); no scores needed.

Every policy keeps the ``sinks`` first and ``window`` most recent tokens whatever their scores.
A selection per KV head (the default) lets heads keep different tokens; per layer, the heads'
scores are summed and all keep the same ones. A sliding-window layer keeps its most recent
tokens (its window is all it reads), and a draft model's cache the sinks and the most recent
ones: it proposes, the target's choice decides.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.core.scheduler import CacheEviction
from kernels.kv_quant import dequantize
from models.kv_spec import KVCacheGroup

POOL = 5  # SnapKV's pooling kernel over neighbouring tokens


class Scorer:
    """A policy's score of each of a layer's ``n`` cached tokens -> [H, n]."""

    name: ClassVar[str]
    needs_scores: ClassVar[bool] = True

    def score(self, keys: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """``keys``: the cached key rows [n, H, R] as stored; ``scores``: the accumulated
        importance [n, H] (None where the group keeps none)."""
        raise NotImplementedError


class SnapKV(Scorer):
    name = "snapkv"

    def score(self, keys, scores):
        pooled = F.avg_pool1d(scores.T[:, None, :], POOL, stride=1, padding=POOL // 2)
        return pooled[:, 0, :]


class H2O(Scorer):
    name = "h2o"

    def score(self, keys, scores):
        return scores.T


class KNorm(Scorer):
    name = "knorm"
    needs_scores = False

    def score(self, keys, scores):
        return -dequantize(keys).norm(dim=-1).T


POLICIES: dict[str, Scorer] = {s.name: s for s in (SnapKV(), H2O(), KNorm())}


def choose(score: torch.Tensor, keep: int, sinks: int, window: int, per_head: bool) -> torch.Tensor:
    """The ``keep`` tokens each head keeps, by ``score`` [H, n], in slot order -> [H, keep]:
    always the first ``sinks`` and last ``window`` (as many as ``keep`` allows)."""
    h, n = score.shape
    sinks = min(sinks, keep)
    window = min(window, keep - sinks)
    score = score.float().clone()
    if not per_head:
        score = score.sum(0, keepdim=True).expand(h, n).clone()
    score[:, :sinks] = float("inf")
    score[:, n - window :] = float("inf")
    return score.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values


def recent(h: int, n: int, keep: int, sinks: int, device) -> torch.Tensor:
    """The first ``sinks`` and the most recent others of ``n`` tokens -> [H, keep]."""
    sinks = min(sinks, keep)
    idx = torch.cat([torch.arange(sinks), torch.arange(n - (keep - sinks), n)])
    return idx.to(device)[None, :].expand(h, keep)


def _slots(table: list[int], idx: torch.Tensor, block_size: int, ring: int) -> torch.Tensor:
    """Cache slots of sequence slots ``idx`` through ``table`` (a ring of ``ring`` entries when
    ``ring`` > 0)."""
    t = torch.tensor(table, dtype=torch.long, device=idx.device)
    logical = idx // block_size
    if ring:
        logical = logical % ring
    return t[logical] * block_size + idx % block_size


def evict(
    e: CacheEviction,
    groups: list[KVCacheGroup],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    scores: list[torch.Tensor | None] | None,
    draft: bool = False,
) -> None:
    """Carry out one eviction on every layer (``draft``: a draft model's cache)."""
    scorer = POLICIES[e.policy]
    for gi, group in enumerate(groups):
        k0 = kv_caches[group.layer_ids[0]][0]
        bs, h = k0.shape[1], k0.shape[2]
        ring = group.spec.table_width(0, bs) if group.spec.window else 0
        old_all = _slots(e.old[gi], torch.arange(e.cached, device=k0.device), bs, ring)
        written = torch.arange(e.keep, device=k0.device)
        if ring:  # only the slots the ring still holds after the eviction are written
            written = written[written >= ((e.keep - 1) // bs - ring + 1) * bs]
        new = _slots(e.new[gi], written, bs, ring)
        heads = torch.arange(h, device=k0.device)[:, None]
        for layer in group.layer_ids:
            k_cache, v_cache = kv_caches[layer]
            plane = None if scores is None else scores[layer]
            if draft or ring:
                idx = recent(h, e.cached, e.keep, 0 if ring else e.sinks, k0.device)
            else:
                keys = k_cache.view(-1, *k_cache.shape[2:])[old_all]
                accumulated = None if plane is None else plane.view(-1, h)[old_all]
                idx = choose(scorer.score(keys, accumulated), e.keep, e.sinks, e.window, e.per_head)
            src = old_all[idx[:, -len(written) :]]  # [H, kept and written]
            tensors = [k_cache] if v_cache.untyped_storage() is k_cache.untyped_storage() else [
                k_cache, v_cache]  # fmt: skip
            for cache in tensors:
                flat = cache.view(-1, *cache.shape[2:])
                flat[new[None, :], heads] = flat[src, heads]
            if plane is not None:
                flat = plane.view(-1, h)
                # SnapKV scores the queries since the last eviction; H2O keeps what it summed.
                moved = flat[src, heads] if e.policy == "h2o" and not draft else 0.0
                flat[new[None, :], heads] = moved
