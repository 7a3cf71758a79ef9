"""Matrices stored in GGUF block formats, as torch modules, and the plain reference of them.

``QuantLinear`` is a linear layer whose weight stays in its block format (``kernels.weights``):
one or more parts stacked by output rows, each with its own format and bias. Its own forward is
the reference: dequantize with gguf-py (llama.cpp's Python package, an implementation independent
of ours) and multiply in torch. A backend swaps it for its kernels when it fits the model to
them (``AttentionBackend.prepare``). ``QuantEmbedding`` dequantizes only the rows looked up.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn

from kernels.weights import FORMATS, Parts, Weight


def ggml_type(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def dequantize(w: Weight) -> torch.Tensor:
    """The float32 [out, in] matrix of a stored weight (the reference)."""
    return dequantize_rows(w, None)


def dequantize_rows(w: Weight, ids: torch.Tensor | None) -> torch.Tensor:
    """Rows ``ids`` (all for None) of a stored weight as float32 [len(ids), in]: by gguf-py from
    the file's layout, by the CPU kernels that made it from a repacked one."""
    if w.format == "dense":
        return (w.data if ids is None else w.data[ids]).float()
    if w.packed:
        from kernels import cpu

        return cpu.dequantize_packed(w, ids)
    data = w.data if ids is None else w.data[ids]
    rows = gguf_dequantize(data.cpu().numpy(), ggml_type(w.format))
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(w.data.device)


def quantize(matrix: torch.Tensor, fmt: str) -> torch.Tensor:
    """A float [out, in] matrix in a block format (gguf-py's quantizer): uint8 [out, bytes]."""
    if fmt not in FORMATS or fmt == "dense":
        raise ValueError(f"cannot quantize to {fmt!r}")
    blocks = gguf_quantize(matrix.detach().float().cpu().numpy(), ggml_type(fmt))
    return torch.from_numpy(np.ascontiguousarray(blocks)).to(matrix.device)


# The K formats gguf-py does not quantize: per format, the byte offsets of its fp16 scales in
# a block and their size for values of about 1.
K_SCALES = {"q4_k": ((0, 2), 0.01), "q5_k": ((0, 2), 0.01), "q6_k": ((208,), 0.004)}


def random_blocks(fmt: str, n: int, k: int, seed: int, size: float = 1.0) -> torch.Tensor:
    """Random weights for tests and benchmarks, uint8 [n, row bytes] of format ``fmt``:
    quantized random rows (32-value formats), random bits under finite fp16 scales (K formats);
    values of about ``size``."""
    g = torch.Generator().manual_seed(seed)
    if fmt not in K_SCALES:
        return quantize(torch.randn(n, k, generator=g) * size, fmt)
    spec = FORMATS[fmt]
    blocks = torch.randint(0, 256, (n, k // spec.block, spec.block_bytes), generator=g)
    blocks = blocks.to(torch.uint8)
    offsets, magnitude = K_SCALES[fmt]
    for off in offsets:
        scale = (torch.rand(n, k // spec.block, generator=g) * magnitude * size).half()
        blocks[:, :, off : off + 2] = scale.view(torch.uint8).view(n, k // spec.block, 2)
    return blocks.view(n, -1)


def stored_bytes(w: Weight) -> int:
    """Bytes the weight takes in memory (its bias included)."""
    size = w.data.numel() * w.data.element_size()
    return size + (0 if w.bias is None else w.bias.numel() * w.bias.element_size())


class QuantLinear(nn.Module):
    """``F.linear`` with a weight stored in parts (``kernels.weights.Parts``).

    The parts' data are buffers (a state dict holds them; ``.to()`` moves them); the biases are
    buffers too, since nothing here trains."""

    def __init__(self, parts: Parts):
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a QuantLinear's parts must share their input size")
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.formats = tuple(p.format for p in parts)
        for i, p in enumerate(parts):
            self.register_buffer(f"data{i}", p.data)
            self.register_buffer(f"bias{i}", p.bias)

    @property
    def parts(self) -> Parts:
        return tuple(
            Weight(getattr(self, f"data{i}"), getattr(self, f"bias{i}"), fmt)
            for i, fmt in enumerate(self.formats)
        )

    @property
    def bias(self) -> torch.Tensor | None:
        biases = [p.bias for p in self.parts]
        if all(b is None for b in biases):
            return None
        return torch.cat([
            b if b is not None else torch.zeros(p.out_features, device=p.data.device)
            for b, p in zip(biases, self.parts)
        ])  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([dequantize(p) for p in self.parts]).to(x.dtype)
        bias = self.bias
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"formats={'+'.join(self.formats)}"
        )


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over a weight in a block format: the looked-up rows are dequantized."""

    def __init__(self, weight: Weight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.format, self.dtype, self.packed = weight.format, dtype, weight.packed
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.register_buffer("data", weight.data)

    @property
    def stored(self) -> Weight:
        return Weight(self.data, None, self.format, self.packed)

    def adopt(self, weight: Weight) -> None:
        """Read ``weight`` from now on: the same matrix in another layout (a tied LM head's,
        repacked), so that the two share one copy."""
        if (weight.format, weight.data.shape) != (self.format, self.data.shape):
            raise ValueError("an embedding adopts only its own matrix")
        self.data, self.packed = weight.data, weight.packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.stored, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
