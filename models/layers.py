"""Building blocks shared by the model definitions.

Each block is plain torch, the reference. ``use_cpu_kernels(model)`` switches a loaded float32
CPU model onto the C++ kernels of ``kernels.cpu``: linear layers become ``FastLinear``, blocks
with a ``use_cpu_kernels`` method switch themselves (fusing projections that read the same
input into one weight), and the parameters keep their names and values.
"""

from __future__ import annotations

import functools
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu
from kernels.cpu import FastLinear
from kernels.weights import DecoderLayerWeights, Weight

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; ``offset=1`` for models that store the weight as w - 1."""

    fused = False

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))

    def use_cpu_kernels(self) -> None:
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu.rms_norm(x, self.weight, self.eps, self.offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.weight.float() + self.offset)).to(x.dtype)


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); ``activation`` is a transformers
    ``hidden_act`` name."""

    def __init__(self, hidden: int, inter: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up: FastLinear | None = None  # gate and up fused, after use_cpu_kernels
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def use_cpu_kernels(self) -> None:
        """Gate and up as one [2 * inter, hidden] weight, and the activation fused."""
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x):
        if self.gate_up is not None:
            return self.down_proj(cpu.gated_act(self.gate_up(x), self.activation))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer (``self_attn``, ``mlp`` a GatedMLP). Once switched to the CPU
    kernels, a step runs all of a model's layers in one call (``fused_layers``).
    Subclasses name their norms in ``norms()``."""

    fused = False

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """Before attention, before the MLP, after attention, after the MLP (None: absent)."""
        raise NotImplementedError

    def use_cpu_kernels(self) -> None:
        self.fused = self.mlp.down_proj.bias is None

    @functools.cached_property
    def fused_args(self) -> tuple[tuple, tuple]:
        """The weights and constants of ``cpu.decoder_layers`` (built after the blocks switched)."""
        a, mlp = self.self_attn, self.mlp
        norm1, norm2, post_attn, post_mlp = self.norms()
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)

        def w(m):
            return None if m is None else m.weight

        weights = DecoderLayerWeights(
            norm1.weight, Weight(a.qkv_proj.weight, a.qkv_proj.bias),
            Weight(a.o_proj.weight, a.o_proj.bias), norm2.weight, Weight(mlp.gate_up.weight),
            Weight(mlp.down_proj.weight), w(q_norm), w(k_norm), w(post_attn), w(post_mlp),
        )  # fmt: skip
        return weights, (norm1.eps, norm1.offset, a.scale, a.num_heads, mlp.activation)


def run_layers(layers, x: torch.Tensor, rope: list, ctx) -> torch.Tensor:
    """``x`` through ``layers`` (``rope`` their (cos, sin)): in one kernel call when
    ``fused_layers`` can, else layer by layer."""
    out = fused_layers(layers, x, rope, ctx)
    if out is None:
        out = x
        for layer, (cos, sin) in zip(layers, rope):
            out = layer(out, cos, sin, ctx)
    return out


def fused_layers(layers, x: torch.Tensor, rope: list, ctx) -> torch.Tensor | None:
    """The output of ``layers`` (DecoderLayers, ``rope`` their (cos, sin)) by one kernel call
    when they are switched to the CPU kernels and the step's caches allow it
    (``ctx.cpu_fused``); None when the modules must run."""
    if not all(layer.fused for layer in layers) or x.shape[0] > cpu.MAX_ROWS:
        return None
    attention = [ctx.cpu_fused(layer.self_attn.layer_id) for layer in layers]
    if any(a is None for a in attention):
        return None
    args = [layer.fused_args for layer in layers]
    weights = [layer_weights for layer_weights, _ in args]
    caches, metas = [(k, v) for k, v, _ in attention], [m for _, _, m in attention]
    return cpu.decoder_layers(x, rope, weights, caches, metas, args[0][1])


def fuse_linears(*linears: nn.Linear) -> FastLinear:
    """One FastLinear computing the concatenated outputs of ``linears`` (same input): their
    weights (and biases) become views into its weight, so nothing is stored twice."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    start = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if has_bias:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return FastLinear(weight, bias)


def use_cpu_kernels(model: nn.Module) -> int:
    """Switch a float32 CPU model onto ``kernels.cpu`` (which must be loaded): blocks switch
    themselves, then every remaining nn.Linear becomes a FastLinear. Returns how many modules
    changed. Only for float32 CPU models: the switched blocks no longer check their inputs."""
    changed = 0
    for module in list(model.modules()):
        if hasattr(module, "use_cpu_kernels"):
            module.use_cpu_kernels()
            changed += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and cpu.usable(child.weight):
                setattr(parent, name, FastLinear(child.weight, child.bias))
                changed += 1
    return changed


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq.float()


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] in the half-split (rotate_half) layout."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """x [T, H, D] rotated by position; cos/sin [T, D]. ``fused``: by the CPU kernel."""
    if fused:
        return cpu.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
