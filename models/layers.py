"""Building blocks shared by the model definitions, in plain torch.

Projections that read the same input are one weight from the start: attention's ``qkv_proj``
(q, k and v) and the MLP's ``gate_up_proj`` (gate and up) are ``PackedLinear`` modules, filled
when the checkpoint is loaded from its separate tensors (a model's ``packed_modules_mapping``,
read by ``models.loader``). A ``DecoderLayer`` describes its weights by name
(``kernels.weights.DecoderLayerWeights``) for a backend that runs whole layers in one call
(``kernels.backend.AttentionBackend.decoder_layers``); the backend decides whether it does, and
fits a loaded model to its kernels once (``prepare``): the modules here never switch.
"""

from __future__ import annotations

import functools
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from kernels.weights import DecoderLayerWeights, Weight

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}

# Checkpoint projections packed into one module at load: checkpoint module name -> (packed
# module, part). nano-vllm's ``packed_modules_mapping``.
QKV_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
GATE_UP_PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class PackedLinear(nn.Linear):
    """One nn.Linear computing several projections of the same input, their outputs side by
    side (``out_sizes``): one weight read per step instead of several."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = tuple(out_sizes)

    def part(self, index: int) -> slice:
        """The output rows of part ``index``."""
        start = sum(self.out_sizes[:index])
        return slice(start, start + self.out_sizes[index])


class RMSNorm(nn.Module):
    """RMSNorm (``kernels.reference.rms_norm``; ``offset=1`` for models that store the weight
    as w - 1), by the backend the model runs on once ``use_backend`` names it (the Triton one
    normalizes in one kernel), else by the torch reference."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.backend = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            return reference.rms_norm(x, self.weight, self.eps, self.offset)
        return self.backend.rms_norm(x, self.weight, self.eps, self.offset)


def use_backend(model: nn.Module, backend) -> None:
    """The model's norms run on ``backend`` (a ``kernels.backend.AttentionBackend``) from now."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.backend = backend


class GatedMLP(nn.Module):
    """down_proj(act(gate) * up), gate and up by one ``gate_up_proj`` [2 * inter, hidden]
    (the checkpoint's gate_proj and up_proj); ``activation`` is a transformers ``hidden_act``
    name."""

    def __init__(self, hidden: int, inter: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = PackedLinear(hidden, (inter, inter), bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer (``self_attn`` with a ``qkv_proj``, ``mlp`` a GatedMLP), as a
    backend that runs whole layers takes it (``kernels.backend.WholeLayer``): its weights by
    name and its constants. Subclasses name their norms in ``norms()``."""

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """Before attention, before the MLP, after attention, after the MLP (None: absent)."""
        raise NotImplementedError

    @property
    def layer_id(self) -> int:
        return self.self_attn.layer_id

    @functools.cached_property
    def weights(self) -> DecoderLayerWeights:
        """The parameters themselves (no copy), named as the kernels take them."""
        a, mlp = self.self_attn, self.mlp
        norm1, norm2, post_attn, post_mlp = self.norms()

        def w(m):
            return None if m is None else m.weight

        def linear(m):
            parts = getattr(m, "parts", None)  # a QuantLinear's, or a swapped one's
            return parts if parts is not None else (Weight(m.weight, m.bias),)

        return DecoderLayerWeights(
            norm1.weight, linear(a.qkv_proj), linear(a.o_proj), norm2.weight,
            linear(mlp.gate_up_proj), linear(mlp.down_proj), w(getattr(a, "q_norm", None)),
            w(getattr(a, "k_norm", None)), w(post_attn), w(post_mlp), key_offset(a),
        )  # fmt: skip

    @property
    def constants(self) -> tuple[float, float, float, int, str]:
        """RMSNorm eps and weight offset, attention scale, query heads, MLP activation."""
        norm = self.norms()[0]
        a = self.self_attn
        return norm.eps, norm.offset, a.scale, a.num_heads, self.mlp.activation


def key_offset(attention: nn.Module) -> torch.Tensor | None:
    """What an attention module subtracts from its keys once rotated, flat (or None)."""
    offset = getattr(attention, "key_offset", None)
    return None if offset is None else offset.float().flatten().contiguous()


def run_layers(layers, x: torch.Tensor, rope: list, ctx) -> torch.Tensor:
    """``x`` through ``layers`` (``rope`` their (cos, sin)): in one call where the backend
    runs whole layers (``decoder_layers``), else module by module."""
    out = ctx.backend.decoder_layers(layers, x, rope, ctx)
    if out is None:
        out = x
        for layer, (cos, sin) in zip(layers, rope):
            out = layer(out, cos, sin, ctx)
    return out


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
