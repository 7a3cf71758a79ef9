"""The per-step attention context a model's layers call into: cache, block tables, backend.

The model runner builds it once per step (with each group's decode plan); layers only read it.

The runner orders each step's sequences decodes first (one new token each), then prefill
chunks. ``attention`` runs prefill attention before the cache write, because a sliding-window
chunk may overwrite ring slots that its own first tokens still read; decode runs after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.backend import AttentionBackend


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors of one KV-cache group for one step (B sequences, T new tokens)."""

    slot_mapping: torch.Tensor  # int64 [T], -1 = do not write
    block_tables: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B], context length after this step
    prefix_lens: torch.Tensor  # int32 [B], tokens cached before this step
    cu_seqlens_q: torch.Tensor  # int32 [B + 1], rows of new tokens per sequence
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    window: int = 0
    decode_plan: Any = None  # the backend's plan for the decodes, made by the runner per step


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    metadata: list[AttentionMetadata]  # one per KV-cache group
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # one (k, v) per layer
    layer_to_group: tuple[int, ...]

    def cpu_fused(self, layer_id: int):
        """``(k_cache, v_cache, metadata)`` of the layer when its cache is float32 and the
        backend ``cpu``: what ``kernels.cpu``'s fused decoder layers need (they write and read
        the cache themselves, decodes and prefill chunks alike). None otherwise."""
        meta = self.metadata[self.layer_to_group[layer_id]]
        k_cache, v_cache = self.kv_caches[layer_id]
        if self.backend.name != "cpu" or k_cache.dtype != torch.float32:
            return None
        return k_cache, v_cache, meta

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] -> [T, Hq, Dv]; writes k, v."""
        meta = self.metadata[self.layer_to_group[layer_id]]
        k_cache, v_cache = self.kv_caches[layer_id]
        nd = meta.num_decodes
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        if q.shape[0] > nd:
            cu = meta.cu_seqlens_q[nd:] - nd
            out[nd:] = self.backend.prefill(
                q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta.block_tables[nd:], cu,
                meta.prefix_lens[nd:], scale, meta.window,
            )  # fmt: skip
        self.backend.write_cache(k_cache, k, meta.slot_mapping)
        if v_cache.untyped_storage() is not k_cache.untyped_storage():  # MLA: V is part of K
            self.backend.write_cache(v_cache, v, meta.slot_mapping)
        if nd:
            out[:nd] = self.backend.decode(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                meta.window, meta.decode_plan,
            )  # fmt: skip
        return out
