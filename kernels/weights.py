"""A decoder layer's weights, described by name, as the kernels take them.

A matrix is a ``Weight``: its stored data in a ``format`` with an optional bias. ``dense`` is a
float tensor [out, in] (float32, or float16 / bfloat16 where the activations stay float32); a
GGUF block format (``q4_0`` … ``q6_k``, ``FORMATS``) is a uint8 tensor [out, row bytes] holding
each output row's blocks exactly as the GGUF file stores them, so a quantized matrix stays at
its file size in memory. Matrices that read the same input are fused once, when the model is
loaded (q, k and v into ``qkv``; gate and up into ``gate_up``): a fused matrix is a tuple of
parts stacked by output rows, one part where every piece has the same format (their rows
concatenated), more where a file stores them differently (Q4_K_M files keep v in Q6_K beside q
and k in Q4_K). A ``DecoderLayerWeights`` names every slot of a pre-norm decoder layer (Llama,
Qwen2, Gemma 3); a model without a slot leaves it None.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class Format:
    """A storage format: its GGML type id (what the C++ kernels dispatch on), values per block
    and bytes per block (1 and 0 for dense: a float tensor)."""

    type_id: int
    block: int
    block_bytes: int


FORMATS = {
    "dense": Format(0, 1, 0),
    "q4_0": Format(2, 32, 18),
    "q4_1": Format(3, 32, 20),
    "q5_0": Format(6, 32, 22),
    "q5_1": Format(7, 32, 24),
    "q8_0": Format(8, 32, 34),
    "q4_k": Format(12, 256, 144),
    "q5_k": Format(13, 256, 176),
    "q6_k": Format(14, 256, 210),
}

# The GGML type of a dense matrix by its dtype (the C++ kernels read all three).
DENSE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}

# Formats a float checkpoint can be quantized to at load (those gguf-py's quantizer writes).
QUANTIZABLE = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


# Rows a block-format matrix is repacked in for the CPU kernels (``kernels.cpu.repacked``):
# groups of PACK_ROWS rows, each block of a group interleaving its rows' values (the layout is
# described in csrc/cpu/qpacked.h). The C++ kernels take a repacked part's GGML type plus PACKED.
PACK_ROWS = 8
PACKED = 256


@dataclass(frozen=True)
class Weight:
    """``packed``: a block-format matrix repacked for the CPU kernels (same bytes and shape,
    another order), which only they and ``kernels.quant.dequantize`` read."""

    data: torch.Tensor
    bias: torch.Tensor | None = None
    format: str = "dense"
    packed: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; known: {tuple(FORMATS)}")
        spec = FORMATS[self.format]
        if self.format != "dense" and (
            self.data.dtype != torch.uint8 or self.data.dim() != 2
            or self.data.shape[1] % spec.block_bytes
        ):  # fmt: skip
            raise ValueError(
                f"a {self.format} weight is uint8 [out, a multiple of {spec.block_bytes} bytes]"
            )
        if self.packed and (self.format == "dense" or self.data.shape[0] % PACK_ROWS):
            raise ValueError(f"only block formats of a multiple of {PACK_ROWS} rows are repacked")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        if self.format == "dense":
            return self.data.shape[1]
        spec = FORMATS[self.format]
        return self.data.shape[1] // spec.block_bytes * spec.block

    @property
    def type_id(self) -> int:
        if self.format == "dense":
            return DENSE_TYPES.get(self.data.dtype, -1)  # -1: no kernel reads it
        return FORMATS[self.format].type_id + (PACKED if self.packed else 0)


Parts = tuple[Weight, ...]  # a fused matrix: parts stacked by output rows


def part_name(slot: str, index: int) -> str:
    """The name of part ``index`` of a fused matrix: ``qkv``, ``qkv.1``, ``qkv.2``."""
    return slot if index == 0 else f"{slot}.{index}"


@dataclass(frozen=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor  # RMSNorm before attention
    qkv: Parts  # q, k and v projections, fused: [(Hq + 2 Hkv) D, hidden]
    o: Parts
    mlp_norm: torch.Tensor  # RMSNorm before the MLP
    gate_up: Parts  # gate and up projections, fused: [2 I, hidden]
    down: Parts
    q_norm: torch.Tensor | None = None  # RMSNorm per head on q and k (Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None  # after attention, before the residual
    post_mlp_norm: torch.Tensor | None = None  # after the MLP, before the residual
    k_offset: torch.Tensor | None = None  # [Hkv * D] off every key once rotated (Qwen2's bias)

    def named_tensors(self) -> dict[str, torch.Tensor | None]:
        """Every tensor by its name, a matrix part's as ``name`` and ``name_bias``
        (``part_name``): what the C++ layer binds by name. Built once: the fused layers read
        it at every step."""
        return self._named[0]

    def named_formats(self) -> dict[str, int]:
        """The GGML type id of every tensor of ``named_tensors`` (0 for dense and norms)."""
        return self._named[1]

    def matrices(self) -> dict[str, Parts]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), tuple)}

    @functools.cached_property
    def _named(self) -> tuple[dict[str, torch.Tensor | None], dict[str, int]]:
        tensors: dict[str, torch.Tensor | None] = {}
        formats: dict[str, int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                for i, part in enumerate(value):
                    name = part_name(f.name, i)
                    tensors[name], tensors[f"{name}_bias"] = part.data, part.bias
                    formats[name], formats[f"{name}_bias"] = part.type_id, 0
            else:
                tensors[f.name], formats[f.name] = value, 0
        return tensors, formats
