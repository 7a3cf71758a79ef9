"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.backend import Rotary
from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from kernels.weights import Weight
from models.config import ModelConfig
from models.kv_spec import FullAttentionSpec, KVCacheGroup
from models.layers import (
    GATE_UP_PACKED,
    QKV_PACKED,
    DecoderLayer,
    GatedMLP,
    PackedLinear,
    RMSNorm,
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


# Positions whose average rotation of the key bias is subtracted from cached keys: a context
# of a few thousand tokens, where channels that turn by less than one revolution keep most of
# their bias and the faster ones average out.
OFFSET_POSITIONS = 4096


def rotated_bias_mean(bias: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """A key bias [Hkv, D] rotated (half-split rotary at ``inv_freq``) by the average rotation
    of positions 0 .. OFFSET_POSITIONS - 1: the constant ``center_keys`` takes off cached keys."""
    angle = torch.arange(OFFSET_POSITIONS, dtype=torch.float64)[:, None] * inv_freq.double()
    c, s = angle.cos().mean(0).float(), angle.sin().mean(0).float()
    half = bias.shape[-1] // 2
    b1, b2 = bias[:, :half], bias[:, half:]
    return torch.cat([b1 * c - b2 * s, b2 * c + b1 * s], -1)


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
        self.key_offset: torch.Tensor | None = None  # [Hkv, D], see ``center_keys``

    def center_keys(self, inv_freq: torch.Tensor) -> torch.Tensor | None:
        """Cache keys less a constant per KV head and value: their k_proj bias rotated by the
        average rotation of positions 0 .. OFFSET_POSITIONS - 1 (None without a bias).

        A constant subtracted from every key adds the same q . o to all of a query's scores:
        softmax, so attention, is unchanged. Qwen2's key bias puts offsets of up to ~150
        on a few slowly rotating channels, which a quantized row's one scale must then span;
        without them the row's values need a fraction of the range."""
        m = self.qkv_proj
        parts = getattr(m, "parts", None) or (Weight(m.weight, m.bias),)  # block formats, dense
        biases = [p.bias for p in parts]
        if all(b is None for b in biases):
            return None
        device = next(b for b in biases if b is not None).device
        bias = torch.cat([
            b.float() if b is not None else torch.zeros(p.out_features, device=device)
            for b, p in zip(biases, parts)
        ])  # fmt: skip
        nq, nk, _ = self.qkv_sizes
        b = bias[nq : nq + nk].view(self.num_kv_heads, self.head_dim)
        self.key_offset = rotated_bias_mean(b, inv_freq).to(bias.device)
        return self.key_offset

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        """How this layer turns its new queries and keys before attention."""
        return Rotary(cos, sin, self.key_offset)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        q, k, v = self.project(x)
        out = ctx.attention(self.layer_id, q, k, v, self.scale, self.rotary(cos, sin))
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
        """How the keys this model caches were rotated: every layer alike, half-split, less
        the layer's key offset where it has one."""
        return RopeLayout(self.inv_freq, offset=self.model.layers[layer_id].self_attn.key_offset)

    def center_cached_keys(self) -> bool:
        """Cache every layer's keys less its constant offset (``LlamaAttention.center_keys``);
        whether any layer has one."""
        offsets = [layer.self_attn.center_keys(self.inv_freq) for layer in self.model.layers]
        return any(o is not None for o in offsets)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        layers = self.model.layers
        return run_layers(layers, x, [(cos, sin)] * len(layers), ctx, self.model.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
