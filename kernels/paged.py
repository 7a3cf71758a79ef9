"""The step a model's layers call into: the attention backend, each KV-cache group's
``AttentionMetadata``, each layer's cache.

The model runner builds it once per step, each group's decode plan made once for all its layers
(``ForwardContext.planned``); layers only read it, and hand it to the backend as the step
(``AttentionBackend.forward``, ``decoder_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.backend import AttentionBackend, AttentionMetadata, KVCache, LatentRotary, Rotary


@dataclass(frozen=True)
class ForwardContext:
    """The step a model's forward runs (mini-sglang's batch): the backend, each group's
    metadata, each layer's cache."""

    backend: AttentionBackend
    metadata: list[AttentionMetadata]  # one per KV-cache group
    kv_caches: list[KVCache]  # one (k, v) per layer
    layer_to_group: tuple[int, ...]
    # One importance-score tensor per layer (None where its group keeps none); None: none.
    scores: list[torch.Tensor | None] | None = None
    # The model's layer count where groups hold layers' recent tokens (``models.kv_spec.
    # with_recent``: their caches sit at the layer's id plus it), else 0.
    recent_layers: int = 0

    @classmethod
    def planned(
        cls,
        backend: AttentionBackend,
        metadata: list[AttentionMetadata],
        kv_caches: list[KVCache],
        layer_to_group: tuple[int, ...],
        scores: list[torch.Tensor | None] | None = None,
        recent_layers: int = 0,
    ) -> ForwardContext:
        """The context with each group's decode plan made once for all its layers (they share
        the group's block tables and block size)."""
        planned = []
        for g, meta in enumerate(metadata):
            if meta.num_decodes:
                kv_cache = kv_caches[layer_to_group.index(g)]
                meta = replace(meta, decode_plan=backend.plan_decode(meta.decodes, kv_cache))
            planned.append(meta)
        return cls(backend, planned, kv_caches, layer_to_group, scores, recent_layers)

    def layer(self, layer_id: int) -> tuple[KVCache, AttentionMetadata]:
        """A layer's cache and its group's metadata."""
        return self.kv_caches[layer_id], self.metadata[self.layer_to_group[layer_id]]

    def recent(self, layer_id: int) -> tuple[KVCache, AttentionMetadata] | None:
        """The cache and metadata of a layer's recent tokens, or None where it has none."""
        at = layer_id + self.recent_layers
        if not self.recent_layers or at >= len(self.kv_caches) or self.kv_caches[at] is None:
            return None
        return self.layer(at)

    def layer_scores(self, layer_id: int) -> torch.Tensor | None:
        return None if self.scores is None else self.scores[layer_id]

    def attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] -> [T, Hq, Dv], q and k turned by
        ``rotary`` first; writes k, v to the layer's cache (``AttentionBackend.forward``)."""
        return self.backend.forward(q, k, v, layer_id, self, scale, rotary)

    def latent_attention(
        self,
        layer_id: int,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        scale: float,
        rotary: LatentRotary,
    ) -> torch.Tensor:
        """An MLA layer's attention over latents -> [T, H, R]; writes its rows to the cache
        (``AttentionBackend.latent_forward``)."""
        return self.backend.latent_forward(q_latent, q_pe, c_kv, k_pe, layer_id, self, scale,
                                           rotary)  # fmt: skip
