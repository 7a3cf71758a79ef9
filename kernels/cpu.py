"""float32 CPU kernels for decode, in C++ with AVX2 (the library under ``csrc/cpu/``).

A decode step multiplies a few activation rows by every weight matrix, so its cost is reading
the weights once. torch's CPU GEMM (MKL) reaches a fraction of the read bandwidth at those
shapes on AMD processors and gets slower, not faster, with a second thread; ``linear`` streams
each weight row once per step across torch's intra-op threads. Around it, one call each replaces
the chains of small torch operations that otherwise cost more than the matmuls at batch 1:
paged decode attention read straight from the block pool, cache writes, RMSNorm, rotary
embedding and gated activations. Their plain torch counterparts (``kernels.reference``,
``models.layers``) stay the reference the tests compare with.

The library is one file per kind of kernel (``linear``, ``attention``, ``cache``, ``pointwise``,
``decoder_layer``), over ``vec.h``, the only file written for the instruction set, and
``threads.h``; ``bindings.cpp`` registers the torch ops. It is built on first use with the system
C++ compiler and cached by torch (under ``$TORCH_EXTENSIONS_DIR``, default
~/.cache/torch_extensions); ``load()`` says why not when it cannot be, and the torch path serves
instead.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.weights import DecoderLayerWeights

SOURCES = Path(__file__).with_name("csrc") / "cpu"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# Input rows up to which ``FastLinear`` takes the kernel and a step's decoder layers are one
# call; above, F.linear (MKL), as fast from ~1024 rows on and faster at 2048 (measured by
# ``python -m bench.cpu --linear``).
MAX_ROWS = 1024
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def load() -> str | None:
    """Build (once per source version) and load the kernels: None when loaded, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not on x86-64 ({platform.machine()})"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the ninja package's binary, outside an active venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(
            name="kvserve_cpu",
            sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
            extra_cflags=FLAGS,
            extra_include_paths=[str(SOURCES)],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path serves
        return f"the CPU kernels did not build ({type(e).__name__}: {str(e).strip()[-300:]})"
    return None


def _ops():
    return torch.ops.kvserve_cpu


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` for float32, weight contiguous [out, in]."""
    return _ops().linear(x, weight, bias)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int):
    """As ``reference.decode_attention``, without gathering the context first."""
    return _ops().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


def write_cache(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    _ops().write_cache(cache, rows, slots)


def rotate_keys(cache: torch.Tensor, blocks: torch.Tensor, cos, sin, start: int, interleaved):
    """As ``rotary.rotate_reference``, given the delta's cos and sin per rotary pair."""
    _ops().rotate_keys(cache, blocks, cos, sin, start, interleaved)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _ops().rms_norm(x, weight, eps, offset)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in the half-split layout; cos/sin [T, D]."""
    return _ops().rope(x, cos, sin)


def gated_act(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h[..., :I]) * h[..., I:] for h [..., 2I]; ``activation`` a transformers name."""
    return _ops().gated_act(h, ACTIVATIONS[activation])


def decoder_layers(
    x, rope: list, layers: list[DecoderLayerWeights], caches: list, metas: list, config: tuple
):
    """Pre-norm decoder layers for a step's new tokens (decodes and prefill chunks), in one call
    (see ``csrc/cpu/decoder_layer.h``). Per layer: ``rope`` its (cos, sin) per token, ``layers``
    its weights, ``caches`` its (k_cache, v_cache), ``metas`` its group's ``AttentionMetadata``.
    ``config`` (eps, norm offset, scale, num_heads, activation). The weights go by name
    (``DecoderLayerWeights.named_tensors``): the kernel binds each to its slot by that name."""
    eps, offset, scale, heads, act = config
    named = [w.named_tensors() for w in layers]
    names = list(named[0]) if named else []
    weights = [n[name] for n in named for name in names]
    return _ops().decoder_layers(
        x, [c for c, _ in rope], [s for _, s in rope], names, weights, [k for k, _ in caches],
        [v for _, v in caches], [m.slot_mapping for m in metas], [m.block_tables for m in metas],
        [m.seq_lens for m in metas], [m.prefix_lens for m in metas],
        [m.cu_seqlens_q for m in metas], [m.num_decodes for m in metas],
        [m.window for m in metas], eps, offset, scale, heads, ACTIVATIONS[act],
    )  # fmt: skip


def usable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


class FastLinear(nn.Module):
    """``F.linear(x, weight, bias)``, by the kernel for inputs of at most ``max_rows`` rows.

    Given an nn.Linear's parameters it holds the same objects (names and ties are kept); given
    plain tensors (a fused weight) they stay plain attributes, not parameters of the model."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = MAX_ROWS):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.max_rows * self.in_features:
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
