"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from models.config import ModelConfig
from models.kv_spec import FullAttentionSpec, KVCacheGroup
from models.layers import (
    GATE_UP_PACKED,
    QKV_PACKED,
    DecoderLayer,
    GatedMLP,
    PackedLinear,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    run_layers,
)
from models.loader import load_by_name


def attention_biases(cfg: ModelConfig) -> tuple[bool, bool]:
    """Whether q, k, v and o have biases: Qwen2's q, k and v do and its o does not; Llama's
    ``attention_bias`` sets all four."""
    if cfg.architecture == "Qwen2ForCausalLM":
        if cfg.get("use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window is not supported")
        return True, False
    bias = cfg.get("attention_bias", False)
    return bias, bias


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        qkv_bias, o_bias = attention_biases(cfg)
        h, d = cfg.hidden_size, self.head_dim
        self.qkv_sizes = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = PackedLinear(h, self.qkv_sizes, bias=qkv_bias)  # the checkpoint's q, k, v
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        self.scale = d**-0.5

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attention(self.layer_id, q, k, v, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.hf["intermediate_size"],
            cfg.get("hidden_act") or "silu",
            cfg.get("mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def norms(self):
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(nn.Module):
    cuda_graphs = True
    packed_modules_mapping = {**QKV_PACKED, **GATE_UP_PACKED}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, theta, scaling), persistent=False
        )

    @staticmethod
    def kv_cache_groups(cfg: ModelConfig, dtype: str) -> list[KVCacheGroup]:
        spec = FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim, dtype)
        return [KVCacheGroup(spec, tuple(range(cfg.num_layers)))]

    def load_weights(self, weights) -> None:
        load_by_name(self, weights)

    def cached_key_rope(self, layer_id: int) -> RopeLayout:
        """How the keys this model caches were rotated: every layer alike, half-split."""
        return RopeLayout(self.inv_freq)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        layers = self.model.layers
        return self.model.norm(run_layers(layers, x, [(cos, sin)] * len(layers), ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
