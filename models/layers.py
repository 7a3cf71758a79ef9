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

import torch
from torch import nn

from kernels import reference
from kernels.reference import ACTIVATIONS
from kernels.weights import DecoderLayerWeights, Weight

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
    normalizes in one kernel), else by the torch reference.

    ``add`` also adds ``x`` to the residual stream first, as vLLM's fused add-norm does: the
    residual add of a pre-norm layer joins the next norm's kernel. Its ``before`` is a norm
    that ``x`` still needs before it is added (Gemma's norm after each sublayer), applied in
    the same call."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.backend = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(x, self.weight, self.eps, self.offset)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor | None, before: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized, new residual) of ``residual + x``; without a residual the stream
        starts here, at x."""
        if residual is None:
            return self(x if before is None else before(x)), x
        if before is not None and (before.eps, before.offset) != (self.eps, self.offset):
            x, before = before(x), None
        w = None if before is None else before.weight
        return self._ops.add_rms_norm(x, residual, self.weight, self.eps, self.offset, w)

    @property
    def _ops(self):
        # The backend's operations have the reference functions' signatures.
        return reference if self.backend is None else self.backend


class GatedMLP(nn.Module):
    """down_proj(act(gate) * up), gate and up by one ``gate_up_proj`` [2 * inter, hidden]
    (the checkpoint's gate_proj and up_proj); ``activation`` is a transformers ``hidden_act``
    name. ``act(gate) * up`` is one operation of the backend (``use_backend``), one kernel on
    the GPU."""

    def __init__(self, hidden: int, inter: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.activation = activation
        self.gate_up_proj = PackedLinear(hidden, (inter, inter), bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.backend = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = reference if self.backend is None else self.backend  # as RMSNorm's
        return self.down_proj(ops.act_mul(self.gate_up_proj(x), self.activation))


def use_backend(model: nn.Module, backend) -> None:
    """The model's norms and MLP activations run on ``backend`` (a
    ``kernels.backend.AttentionBackend``) from now."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedMLP)):
            module.backend = backend


class PreNormLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): ``self_attn``, ``mlp``,
    ``input_layernorm`` and ``post_attention_layernorm``, the residual stream in and out as
    ``layer_by_layer`` carries it."""

    def forward(self, x, residual, before, cos, sin, ctx):
        h, residual = self.input_layernorm.add(x, residual, before)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, cos, sin, ctx), residual)
        return self.mlp(h), residual


class DecoderLayer(PreNormLayer):
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


def layer_by_layer(layers, x: torch.Tensor, rope: list, ctx, norm: RMSNorm) -> torch.Tensor:
    """``x`` through ``layers`` (``rope`` their (cos, sin)) and the final ``norm``, module by
    module. Between layers the residual stream is (x, residual): each layer's input norm adds
    x to the residual (``RMSNorm.add``), and a layer's ``output_norm`` is the norm its output
    x still needs on the way (``RMSNorm.add``'s ``before``)."""
    residual, before = None, None
    for layer, (cos, sin) in zip(layers, rope):
        x, residual = layer(x, residual, before, cos, sin, ctx)
        before = getattr(layer, "output_norm", None)
    return norm.add(x, residual, before)[0]


def run_layers(layers, x: torch.Tensor, rope: list, ctx, norm: RMSNorm) -> torch.Tensor:
    """``x`` through ``layers`` (``rope`` their (cos, sin)) and the final ``norm``: in one call
    where the backend runs whole layers (``decoder_layers``), else ``layer_by_layer``."""
    out = ctx.backend.decoder_layers(layers, x, rope, ctx)
    if out is not None:
        return norm(out)
    return layer_by_layer(layers, x, rope, ctx, norm)


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
