"""What a model must provide to be served: the ``CausalLM`` protocol.

To add an architecture: write a module with an ``nn.Module`` class that has these members
(``models/llama.py`` is the shortest example), and name it in ``models.loader.ARCHITECTURES``
under the ``architectures`` string of its config.json. Attention goes through
``ForwardContext.attention(layer_id, q, k, v, scale, rotary)``, which turns q and k by the
layer's ``kernels.backend.Rotary`` (norms, rotary, key offset), reads and writes the paged
cache; the model never sees block tables. Projections that read the same input are packed into one
module when the checkpoint is loaded (``packed_modules_mapping``). Tests compare the new class
with transformers' own on the same weights (tests/models/).

Optional: ``center_cached_keys() -> bool``, called once when the KV cache is quantized: from
then on the model caches its keys less a constant per layer and KV head (``cached_key_rope``
then carries it as ``offset``), so that a quantized row's scale spans less (``models/llama.py``
for Qwen2's key bias).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from models.config import ModelConfig
from models.kv_spec import KVCacheGroup


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig
    # Whether ``forward`` can be captured in a CUDA graph: no host syncs (``.item()``,
    # ``.tolist()``), no tensors built from host data, no shapes that depend on values.
    cuda_graphs: bool
    # Checkpoint projections the loader packs into one module: checkpoint module name ->
    # (packed module, part), e.g. {"q_proj": ("qkv_proj", 0), ...} (``models.loader``).
    packed_modules_mapping: dict[str, tuple[str, int]]

    def __init__(self, cfg: ModelConfig) -> None:
        """Build the layers with empty weights (in the default dtype and device)."""

    @staticmethod
    def kv_cache_groups(cfg: ModelConfig, dtype: str) -> list[KVCacheGroup]:
        """The layers grouped by cache layout; a static method, so that capacity can be
        planned from config.json alone, without building the model."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from a checkpoint's (name, tensor) pairs."""

    def cached_key_rope(self, layer_id: int) -> RopeLayout | None:
        """How the keys a layer caches were rotated, so a context shift can turn them to new
        positions; None when they cannot be (no rotary embedding): shift and sink refuse."""
        ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Token ids [T] at ``positions`` [T] -> final hidden states [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] -> logits [n, vocab]."""
        ...
