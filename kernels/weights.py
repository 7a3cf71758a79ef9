"""A decoder layer's weights, described by name, as the kernels take them.

A matrix is a ``Weight``: its stored data in a ``format`` (``dense``: a float tensor
[out, in]; the GGUF block formats join by name), with an optional bias. Matrices that read the
same input are fused once, when the model is loaded (q, k and v into ``qkv``; gate and up into
``gate_up``), so nothing decides it at run time. A ``DecoderLayerWeights`` names every slot of
a pre-norm decoder layer (Llama, Qwen2, Gemma 3); a model without a slot leaves it None.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

FORMATS = ("dense",)


@dataclass(frozen=True)
class Weight:
    data: torch.Tensor
    bias: torch.Tensor | None = None
    format: str = "dense"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; known: {FORMATS}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor  # RMSNorm before attention
    qkv: Weight  # q, k and v projections, fused: [(Hq + 2 Hkv) D, hidden]
    o: Weight
    mlp_norm: torch.Tensor  # RMSNorm before the MLP
    gate_up: Weight  # gate and up projections, fused: [2 I, hidden]
    down: Weight
    q_norm: torch.Tensor | None = None  # RMSNorm per head on q and k (Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None  # after attention, before the residual
    post_mlp_norm: torch.Tensor | None = None  # after the MLP, before the residual

    def named_tensors(self) -> dict[str, torch.Tensor | None]:
        """Every tensor by its name, a matrix's as ``name`` and ``name_bias``: what the C++
        layer binds by name. Built once: the fused layers read it at every step."""
        return self._named

    @functools.cached_property
    def _named(self) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Weight):
                out[f.name], out[f"{f.name}_bias"] = value.data, value.bias
            else:
                out[f.name] = value
        return out
