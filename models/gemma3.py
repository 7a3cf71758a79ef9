"""Gemma 3 text decoder: interleaved sliding-window (local) and full (global) attention layers.

Differences from Llama, as transformers' ``Gemma3ForCausalLM`` has them: embeddings scaled by
sqrt(hidden) in the model dtype; RMSNorm weights stored as w - 1; RMSNorm on q and k per head;
norms before *and* after attention and the MLP; GELU-tanh MLP; scores scaled by
``query_pre_attn_scalar ** -0.5``; rope base per layer kind; tied embeddings; optional final
logit softcapping. Local layers keep their K/V in a ring (``SlidingWindowSpec``) whose window
counts the current token, as transformers' mask ``kv_idx > q_idx - sliding_window`` does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.backend import Rotary
from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from models.config import ModelConfig
from models.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from models.layers import (
    GATE_UP_PACKED,
    QKV_PACKED,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    rope_cos_sin,
    run_layers,
)
from models.llama import LlamaAttention
from models.loader import load_by_name

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        return list(types)
    # Older configs give only the period: every `pattern`-th layer is global.
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_layers)]


def rope_parameters(cfg: ModelConfig) -> dict[str, dict]:
    """Rope settings per layer kind, from transformers 5's nested ``rope_parameters`` or from the
    flat keys of older configs (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    return {FULL: full, SLIDING: local}


def gemma_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    # float32 throughout, as transformers computes it: at positions in the thousands a
    # float64-derived table rotates keys by a visibly different angle.
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind not in ("default", None):
        raise ValueError(f"unsupported rope type {kind!r} for Gemma 3")
    return inv_freq


class Gemma3Attention(LlamaAttention):
    """Llama's attention with RMSNorm on q and k per head, and its own score scale."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.scale = cfg.get("query_pre_attn_scalar", self.head_dim) ** -0.5

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        q, k = self.q_norm, self.k_norm
        assert (q.eps, q.offset) == (k.eps, k.offset)
        return Rotary(cos, sin, None, (q.weight, k.weight, q.eps, q.offset))


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, kind: str):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        h = cfg.hidden_size
        self.kind = kind
        self.self_attn = Gemma3Attention(cfg, layer_id)
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(h, cfg.hf["intermediate_size"], act)
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def norms(self):
        return (
            self.input_layernorm,
            self.pre_feedforward_layernorm,
            self.post_attention_layernorm,
            self.post_feedforward_layernorm,
        )

    @property
    def output_norm(self) -> RMSNorm:
        """The norm of the MLP's output, applied by the next norm's call with the residual
        add (``models.layers.layer_by_layer``)."""
        return self.post_feedforward_layernorm

    def forward(self, x, residual, before, cos, sin, ctx):
        h, residual = self.input_layernorm.add(x, residual, before)
        attn = self.self_attn(h, cos, sin, ctx)
        h, residual = self.pre_feedforward_layernorm.add(
            attn, residual, self.post_attention_layernorm
        )
        return self.mlp(h), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, kinds: list[str]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, kind) for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6), offset=1.0)


class Gemma3ForCausalLM(nn.Module):
    cuda_graphs = True
    packed_modules_mapping = {**QKV_PACKED, **GATE_UP_PACKED}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError(
                "attention logit softcapping is not supported by the attention kernels"
            )
        self.config = cfg
        kinds = layer_types(cfg)
        self.model = Gemma3Model(cfg, kinds)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        # sqrt(hidden) rounded through fp32 to the dtype the model is built in (load_model builds
        # it in the model dtype), as the reference does (bf16: sqrt(640) -> 25.25): a Python
        # float, so that the forward multiplies by a host scalar and builds no tensor.
        dtype = self.model.embed_tokens.weight.dtype
        scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=torch.float32, device="cpu")
        self.embed_scale = scale.to(dtype).item()
        self.final_softcap = cfg.get("final_logit_softcapping")
        rope = rope_parameters(cfg)
        for kind in (FULL, SLIDING):
            self.register_buffer(
                f"{kind}_inv_freq", gemma_inv_freq(cfg.head_dim, rope[kind]), persistent=False
            )

    @staticmethod
    def kv_cache_groups(cfg: ModelConfig, dtype: str) -> list[KVCacheGroup]:
        kinds = layer_types(cfg)
        local = tuple(i for i, kind in enumerate(kinds) if kind == SLIDING)
        full = tuple(i for i, kind in enumerate(kinds) if kind != SLIDING)
        groups = []
        if local:
            window = cfg.get("sliding_window")
            if not window:
                raise ValueError("Gemma 3 config has sliding layers but no sliding_window")
            spec = SlidingWindowSpec(cfg.num_kv_heads, cfg.head_dim, dtype, window_size=window)
            groups.append(KVCacheGroup(spec, local))
        if full:
            spec = FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim, dtype)
            groups.append(KVCacheGroup(spec, full))
        return groups

    def load_weights(self, weights) -> None:
        load_by_name(self, weights)

    def _rope_kind(self, layer_id: int) -> str:
        return SLIDING if self.model.layers[layer_id].kind == SLIDING else FULL

    def cached_key_rope(self, layer_id: int) -> RopeLayout:
        """How a layer's cached keys were rotated: half-split, with its kind's rope base."""
        return RopeLayout(getattr(self, f"{self._rope_kind(layer_id)}_inv_freq"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        x = self.model.embed_tokens(input_ids)
        x = x * self.embed_scale
        rope = {
            kind: rope_cos_sin(positions, getattr(self, f"{kind}_inv_freq"), x.dtype)
            for kind in (FULL, SLIDING)
        }
        per_layer = [rope[self._rope_kind(i)] for i in range(len(self.model.layers))]
        return run_layers(self.model.layers, x, per_layer, ctx, self.model.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
