"""DeepSeek-V3: multi-head latent attention (MLA) over a latent KV cache, and sigmoid-gated MoE.

The cache holds, per token and layer, one row ``[kv_a_layernorm(c_kv), rope(k_pe)]``
(kv_lora_rank + qk_rope_head_dim values) shared by all heads. Attention runs on that row
directly, for prefill and decode alike, by absorbing ``kv_b_proj`` into the two ends::

    kv_b_proj.weight [H * (nope + v), r] -> per head W_UK [nope, r], W_UV [v, r]
    score  = q_nope . (W_UK c_kv) + q_pe . k_pe  = (W_UK^T q_nope) . c_kv + q_pe . k_pe
    output = sum_j p_j W_UV c_kv_j               = W_UV (sum_j p_j c_kv_j)

so the query is ``[W_UK^T q_nope, q_pe]`` (one KV head: MQA over latents), the value is the
first kv_lora_rank columns of the same cache row, and W_UV is applied after attention.

The routed experts are held stacked (``Experts``). A decode batch gathers each token's chosen
experts' weights and applies them by batched matmuls: no host sync and no shape that depends
on the routing, so decode steps can be captured in CUDA graphs. Larger token counts (prefill)
sort the tokens by expert and run each chosen expert once.

Under tensor parallelism (``models.tensor_parallel``) a rank builds this model with 1/N of the
heads (its rows of ``q_b_proj`` and ``kv_b_proj``, its columns of ``o_proj``) and of each MLP's
and expert's columns; the latent row is computed and cached whole on every rank.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import LatentRotary
from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from models.config import ModelConfig
from models.kv_spec import KVCacheGroup, MLASpec
from models.layers import (
    ACTIVATIONS,
    GATE_UP_PACKED,
    GatedMLP,
    PackedLinear,
    PreNormLayer,
    RMSNorm,
    layer_by_layer,
)
from models.loader import load_by_name

QKV_A_PACKED = {"q_a_proj": ("qkv_a_proj", 0), "kv_a_proj_with_mqa": ("qkv_a_proj", 1)}
# transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def rope_parameters(cfg: ModelConfig) -> dict:
    """The rope settings under either spelling (transformers 5 ``rope_parameters``, or older
    ``rope_theta`` + ``rope_scaling``), with ``rope_type`` and ``rope_theta`` always set."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq [qk_rope_head_dim / 2] and the factor cos/sin are scaled by, as transformers."""
    params = rope_parameters(cfg)
    dim, base = cfg.hf["qk_rope_head_dim"], params["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if params["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    if params["rope_type"] != "yarn":
        raise ValueError(f"unsupported rope type {params['rope_type']!r} for DeepSeek-V3")
    original = params.get("original_max_position_embeddings", cfg.max_position_embeddings)
    factor = params.get("factor") or cfg.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under yarn."""
    scale = (cfg.hf["qk_nope_head_dim"] + cfg.hf["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(cfg)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        hf = cfg.hf
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.q_lora_rank = hf.get("q_lora_rank")
        self.kv_lora_rank = hf["kv_lora_rank"]
        self.nope_dim, self.rope_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim = hf["v_head_dim"]
        self.interleave = hf.get("rope_interleave", True)
        self.scale = softmax_scale(cfg)
        h, bias = cfg.hidden_size, hf.get("attention_bias", False)
        q_out = self.num_heads * (self.nope_dim + self.rope_dim)
        latent = self.kv_lora_rank + self.rope_dim
        if self.q_lora_rank:
            # The checkpoint's q_a_proj and kv_a_proj_with_mqa, both of the layer's input.
            self.qkv_a_proj = PackedLinear(h, (self.q_lora_rank, latent), bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_out, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(h, latent, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t, r = x.shape[0], self.kv_lora_rank
        if self.q_lora_rank:
            q_a, kv_a = self.qkv_a_proj(x).split([self.q_lora_rank, r + self.rope_dim], -1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        c_kv, k_pe = kv_a.split([r, self.rope_dim], -1)
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, r).split(
            [self.nope_dim, self.v_dim], dim=1
        )
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        norm = self.kv_a_layernorm
        rotary = LatentRotary(cos, sin, self.interleave, (norm.weight, norm.eps))
        # The value is the cached row's latent, so the cache stores each latent once.
        latent_out = ctx.latent_attention(
            self.layer_id, q_latent, q_pe, c_kv, k_pe, self.scale, rotary
        )
        out = torch.einsum("thr,hvr->thv", latent_out, w_uv)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class TopkRouter(nn.Module):
    """Sigmoid scores; experts are chosen on score + bias within the best groups, but weighted
    by the score alone (auxiliary-loss-free balancing)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf
        self.num_experts = hf["n_routed_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.num_groups = hf.get("n_group") or 1
        self.topk_groups = hf.get("topk_group") or 1
        self.norm_topk_prob = hf.get("norm_topk_prob", True)
        self.routed_scaling_factor = hf.get("routed_scaling_factor", 1.0)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        # Kept in fp32 at any model dtype, as transformers does: the bias decides close calls.
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> fp32 weights [T, top_k], expert ids [T, top_k]."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, best_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


# Token counts up to this run the routed experts on the gathered path, which makes no host
# sync and whose shapes depend only on the token count: it covers every decode batch the engine
# captures in a CUDA graph (engine.worker.cuda_graphs.BATCH_SIZES, up to 256). Larger counts
# (prefill) take the grouped path, which reads each chosen expert's weights once.
GATHER_MAX_TOKENS = 256
# Expert weights the gathered path copies at once, in bytes: it runs over chunks of tokens, so
# that a large batch of a large model never holds T * top_k copies of an expert's weights.
GATHER_CHUNK_BYTES = 1 << 28


class Experts(nn.Module):
    """The routed experts' gated MLPs, stacked as transformers holds them: ``gate_up_proj``
    [E, 2 * inter, hidden] (each expert's gate rows, then its up rows) and ``down_proj``
    [E, hidden, inter]. Checkpoints name them per expert (``experts.E.gate_proj.weight``);
    ``expert_piece`` places those.

    Both paths give, per token, ``sum_k weights[k] * expert_{ids[k]}(x)``, the products summed
    in fp32 over the slots. Under tensor parallelism ``inter`` is the rank's share, and the
    sum is a partial one (the MoE module's output is all-reduced)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.num_experts, self.inter = num_experts, inter
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], fp32 weights [T, top_k], expert ids [T, top_k] -> [T, hidden]."""
        if x.shape[0] <= GATHER_MAX_TOKENS:
            y = self.gathered(x, ids)
        else:
            y = self.grouped(x, ids)
        return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)

    def gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s expert output [T, top_k, hidden], from the chosen experts'
        weights gathered per (token, slot) and batched matmuls, as gpt-fast does for decode:
        no host sync, no shape that depends on the routing."""
        top_k = ids.shape[1]
        pair_bytes = self.gate_up_proj[0].numel() * self.gate_up_proj.element_size()
        chunk = max(1, GATHER_CHUNK_BYTES // (top_k * pair_bytes))
        outs = []
        for start in range(0, x.shape[0], chunk):
            xs, chosen = x[start : start + chunk], ids[start : start + chunk]
            t = xs.shape[0]
            # [t, top_k * 2 * inter, hidden] @ [t, hidden, 1]: one matrix-vector product per token.
            w13 = self.gate_up_proj[chosen].flatten(1, 2)
            gate, up = torch.bmm(w13, xs[:, :, None]).view(t, top_k, -1).split(self.inter, -1)
            h = (self.act(gate) * up).reshape(t * top_k, self.inter, 1)
            # [t * top_k, hidden, inter] @ [t * top_k, inter, 1]: one per (token, slot).
            w2 = self.down_proj[chosen].flatten(0, 1)
            outs.append(torch.bmm(w2, h).view(t, top_k, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same [T, top_k, hidden], with the (token, slot) pairs sorted by expert and each
        chosen expert run once on its rows. Reads the per-expert counts on the host (a sync, and
        shapes that depend on the routing): for prefill, not captured."""
        t, top_k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[order // top_k]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                part = rows[start : start + n]
                gate, up = F.linear(part, self.gate_up_proj[e]).split(self.inter, dim=-1)
                outs.append(F.linear(self.act(gate) * up, self.down_proj[e]))
            start += n
        y = torch.empty(t * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        y[order] = torch.cat(outs)
        return y.view(t, top_k, -1)


_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def expert_piece(name: str, num_experts: int, inter: int) -> tuple[str, tuple] | None:
    """Where a checkpoint's per-expert weight goes in the stacked ``Experts`` parameters:
    (parameter name, index), or None for a name that is not one."""
    m = _EXPERT_RE.fullmatch(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if e >= num_experts:
        raise ValueError(f"checkpoint tensor {name!r}: there are {num_experts} experts")
    if proj == "down":
        return f"{prefix}.down_proj", (e,)
    rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
    return f"{prefix}.gate_up_proj", (e, rows)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf
        h, inter = cfg.hidden_size, hf["moe_intermediate_size"]
        act = cfg.get("hidden_act") or "silu"
        self.gate = TopkRouter(cfg)
        self.experts = Experts(hf["n_routed_experts"], h, inter, act)
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = GatedMLP(h, inter * shared, act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(cfg, layer_id)
        if layer_id >= cfg.get("first_k_dense_replace", 0):
            self.mlp = MoE(cfg)
        else:
            act = cfg.get("hidden_act") or "silu"
            self.mlp = GatedMLP(cfg.hidden_size, cfg.hf["intermediate_size"], act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6))


def _check_supported(cfg: ModelConfig) -> None:
    expected = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    for key, value in expected.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"DeepSeek-V3 {key}={cfg.get(key)!r} is not supported ({value!r})")


class DeepseekV3ForCausalLM(nn.Module):
    # Decode batches (up to GATHER_MAX_TOKENS tokens) route on the device; MLA attention goes
    # through the cache like any other. Prefill's grouped MoE syncs, but it is not captured.
    cuda_graphs = True
    # The dense and shared-expert MLPs' gate and up, and with a query LoRA its two projections of
    # the layer's input; MLA's q_proj stays a projection of its own.
    packed_modules_mapping = {**GATE_UP_PACKED, **QKV_A_PACKED}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _check_supported(cfg)
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_attention_factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    @staticmethod
    def kv_cache_groups(cfg: ModelConfig, dtype: str) -> list[KVCacheGroup]:
        spec = MLASpec(cfg.hf["kv_lora_rank"], cfg.hf["qk_rope_head_dim"], dtype)
        return [KVCacheGroup(spec, tuple(range(cfg.num_layers)))]

    def cached_key_rope(self, layer_id: int) -> RopeLayout:
        """The rotary tail of each latent row. ``apply_rope`` writes it half-split whichever
        pairing it read, and the yarn factor it carries is kept by a pure rotation."""
        return RopeLayout(self.inv_freq, start=self.config.hf["kv_lora_rank"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.rope_attention_factor).to(x.dtype)
        sin = (freqs.sin() * self.rope_attention_factor).to(x.dtype)
        layers = self.model.layers
        return layer_by_layer(layers, x, [(cos, sin)] * len(layers), ctx, self.model.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        num_layers = self.config.num_layers
        layer_re = re.compile(r"model\.layers\.(\d+)\.")

        def kept():
            for name, tensor in weights:
                if name.endswith("weight_scale_inv"):
                    raise ValueError(f"{name}: FP8 block-quantized checkpoints are not supported")
                m = layer_re.match(name)
                # Layers past num_hidden_layers are multi-token-prediction modules, unused here.
                if m and int(m.group(1)) >= num_layers:
                    continue
                yield name, tensor

        hf = self.config.hf
        experts, inter = hf["n_routed_experts"], hf["moe_intermediate_size"]
        load_by_name(self, kept(), lambda name: expert_piece(name, experts, inter))
