"""float32 CPU kernels for decode, in C++ with AVX2 or AVX-512 (the library under ``csrc/cpu/``).

A decode step multiplies a few activation rows by every weight matrix, so its cost is reading
the weights once. torch's CPU GEMM (MKL) reaches a fraction of the read bandwidth at those
shapes on AMD processors and gets slower, not faster, with a second thread; ``linear`` streams
each weight row once per step across torch's intra-op threads. Around it, one call each replaces
the chains of small torch operations that otherwise cost more than the matmuls at batch 1:
paged decode attention read straight from the block pool, cache writes, RMSNorm, rotary
embedding and gated activations. Their plain torch counterparts (``kernels.reference``,
``models.layers``) stay the reference the tests compare with.

The KV cache may be stored in any format of ``kernels.kv_quant`` (float32, float16, bfloat16,
int8, fp8_e4m3, int4): the cache writes quantize as the reference does, byte for byte (int4's
rotation up to a rounding), and attention reads the stored rows, a tile at a time converted
once for every query head that reads it (``kv_format.h``).

Weights may stay in their GGUF block formats (``kernels.weights``): the products round the
activations to two int8 digits per group of 32 values (64 for the K formats), x = d (254 q + ql),
and multiply bytes (``qlinear``, ``qtiles``), reading a Q4_K matrix at about a seventh of its
float32 size.

The library is one file per kind of kernel (``linear``, ``qlinear``, ``qtiles``, ``attention``,
``cache``, ``kv_format``, ``pointwise``, ``decoder_layer``), over ``vec.h`` and ``qdot.h``, the
files written for the instruction set (``qformats.h`` lays out the block formats), and
``threads.h``;
``bindings.cpp`` and ``layer_args.cpp`` register the torch ops. It is built on first use with
the system C++ compiler, once per instruction set (``ISAS``: ``avx2``, ``avx512`` with VNNI,
each its own op namespace), and cached by torch (under ``$TORCH_EXTENSIONS_DIR``, default
~/.cache/torch_extensions; ``build_lock`` lets one process at a time build each). ``load()``
builds the best one the machine runs (``$KVSERVE_CPU_ISA`` forces one) and says why not when it
cannot, and the torch path serves instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kv_quant import KV_DTYPES, per_channel, value_dim
from kernels.weights import PACK_ROWS, PACKED, DecoderLayerWeights, Parts, Weight

SOURCES = Path(__file__).with_name("csrc") / "cpu"
FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wextra"]
# The builds, best last: each the CPU flags (/proc/cpuinfo) it needs and the compiler's. The
# avx512 one multiplies bytes by AVX-512 VNNI (qdot.h).
ISAS = {
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
    "avx512": (
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
        ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    ),
}
ISA_ENV = "KVSERVE_CPU_ISA"
# Input rows up to which ``FastLinear`` takes the kernel and a step's decoder layers are one
# call; above, F.linear (MKL), as fast from ~1024 rows on and faster at 2048 (measured by
# ``python -m bench.cpu --linear``).
MAX_ROWS = 1024
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """Read once: every kernel call asks which build to use (``ops``), and /proc/cpuinfo costs
    ~0.1 ms to read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def isas() -> list[str]:
    """The builds this machine can run, best last (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = _cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if needs <= flags]


def chosen_isa() -> str | None:
    """``$KVSERVE_CPU_ISA`` if set, else the best build the machine runs (None: none)."""
    runnable = isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: known builds are {', '.join(ISAS)}")
        if forced not in runnable:
            missing = ISAS[forced][0] - _cpu_flags()
            raise RuntimeError(
                f"{ISA_ENV}={forced}: this CPU cannot run it (lacks {', '.join(sorted(missing))})"
            )
        return forced
    return runnable[-1] if runnable else None


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold the build in ``directory`` for this process until the block ends. torch marks a
    build in progress with a file ``lock`` there, which a killed build leaves behind, and waits
    for it to go, forever; an flock goes with the process holding it, so with ours held a
    ``lock`` file is one such leftover."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvserve.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def build(isa: str) -> str | None:
    """Build (once per source version) and load the ``isa`` library: None when loaded, else
    why not."""
    if isa not in isas():
        return f"the CPU cannot run the {isa} build (or is not x86-64: {platform.machine()})"
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the ninja package's binary, outside an active venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        name = f"kvserve_cpu_{isa}"
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        directory = Path(root) / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}"
        with build_lock(directory):
            cpp_extension.load(
                name=name,
                sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
                extra_cflags=[*FLAGS, *ISAS[isa][1], f"-DKVSERVE_OPS={name}"],
                # Both builds may be loaded at once: each calls its own copies of the kernels.
                extra_ldflags=["-Wl,-Bsymbolic"],
                extra_include_paths=[str(SOURCES)],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path serves
        return f"the CPU kernels did not build ({type(e).__name__}: {str(e).strip()[-300:]})"
    return None


@functools.cache
def load() -> str | None:
    """Build and load the chosen build (``chosen_isa``): None when loaded, else why not."""
    try:
        isa = chosen_isa()
    except (ValueError, RuntimeError) as e:
        return str(e)
    if isa is None:
        if not isas() and platform.machine() in ("x86_64", "AMD64"):
            return "the CPU lacks avx2, fma or f16c"
        return f"not on x86-64 ({platform.machine()})"
    return build(isa)


def ops(isa: str | None = None):
    """The torch ops of the ``isa`` build (built on first use), default the chosen one."""
    isa = isa or chosen_isa()
    why = build(isa)
    if why is not None:
        raise RuntimeError(why)
    return getattr(torch.ops, f"kvserve_cpu_{isa}")


def _ops():
    return ops()


def _as_parts(weights: Parts | Weight) -> Parts:
    return (weights,) if isinstance(weights, Weight) else tuple(weights)


def linear(x: torch.Tensor, parts: Parts | Weight, isa: str | None = None) -> torch.Tensor:
    """``x`` [..., in] times a matrix in parts (``kernels.weights``): float32 x, dense parts
    contiguous float32, float16 or bfloat16 [out, in], block-format parts as stored; each
    part's bias added."""
    parts = _as_parts(parts)
    return ops(isa).linear(
        x, [p.data for p in parts], [p.bias for p in parts], [p.type_id for p in parts]
    )


def repacked(parts: Parts, done: dict | None = None) -> Parts:
    """The block-format parts of a matrix repacked for the products (``csrc/cpu/qpacked.h``),
    where every part has a multiple of ``PACK_ROWS`` rows (the chunks the threads take then
    start on a group of every part); else the parts as they are. ``done`` maps a tensor already
    repacked (a tied embedding's, say) to its repacked copy, which is then shared, not made
    again."""
    parts = _as_parts(parts)
    if any(p.out_features % PACK_ROWS for p in parts):
        return parts
    done = {} if done is None else done
    out = []
    for p in parts:
        if p.format == "dense" or p.packed:
            out.append(p)
            continue
        key = (p.data.data_ptr(), tuple(p.data.shape))
        if key not in done:
            done[key] = ops().repack(p.data.contiguous(), p.type_id)
        out.append(Weight(done[key], p.bias, p.format, packed=True))
    return tuple(out)


def dequantize_packed(w: Weight, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (all for None) of a repacked weight as float32 [len(ids), in]."""
    if ids is None:
        ids = torch.arange(w.out_features)
    return ops().dequantize_packed(w.data, w.type_id - PACKED, ids)


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale: float,
    window: int,
    scores: torch.Tensor | None = None,
    score_from: torch.Tensor | None = None,
    isa: str | None = None,
    recent: tuple | None = None,
):
    """As ``reference.decode_attention``, without gathering the context first: the caches read
    in their format (``takes_cache``), in float32 whatever q's dtype. ``scores`` (float32,
    contiguous; full attention only) get the attention of the sequences ``score_from`` counts,
    as the reference adds it. ``recent``: (k cache, v cache, block tables, tokens) of the
    layer's recent rows, read as ``reference.recent_decode_attention`` reads them."""
    rk, rv, rtables, tokens = recent or (None, None, None, 0)
    out = ops(isa).decode_attention(
        q.float(), k_cache, v_cache, block_tables, seq_lens, scale, window, scores, score_from,
        rk, rv, rtables, tokens,
    )  # fmt: skip
    return out.to(q.dtype)


def write_cache(
    cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, isa: str | None = None
) -> None:
    """As ``reference.write_cache``: ``rows`` quantized to the cache's format."""
    ops(isa).write_cache(cache, rows, slots)


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
    x,
    rope: list,
    layers: list[DecoderLayerWeights],
    caches: list,
    metas: list,
    config: tuple,
    scores: list | None = None,
    isa: str | None = None,
    recents: list | None = None,
):
    """Pre-norm decoder layers for a step's new tokens (decodes and prefill chunks), in one call
    (see ``csrc/cpu/decoder_layer.h``). Per layer: ``rope`` its (cos, sin) per token, ``layers``
    its weights, ``caches`` its (k_cache, v_cache) in any format ``takes_cache`` takes (a prefill
    chunk reads its own keys and values as the cache gives them back), ``metas`` its group's
    ``AttentionMetadata``.
    ``config`` (eps, norm offset, scale, num_heads, activation). The weights go by name
    (``DecoderLayerWeights.named_tensors``): the kernel binds each to its slot by that name.
    ``scores``: per layer its importance scores or None; a layer's are added to as
    ``decode_attention``'s, the rows its meta's ``score_from`` counts (its slots already
    cleared: ``reference.clear_scores``). ``recents``: per layer the (k cache, v cache) and
    ``AttentionMetadata`` of its recent rows, or None (``reference.recent_prefill_attention``
    and ``recent_decode_attention`` read them)."""
    eps, offset, scale, heads, act = config
    scores = scores or [None] * len(layers)
    recents = recents or [None] * len(layers)
    nothing = (None, None, None, None, 0)
    recent_args = [
        nothing if r is None else (*r[0], r[1].slot_mapping, r[1].block_tables, r[1].window)
        for r in recents
    ]
    froms = [None if s is None else m.score_from for s, m in zip(scores, metas)]
    named = [w.named_tensors() for w in layers]
    # Layers may store a matrix in different numbers of parts: the names of all, None where a
    # layer has no such part.
    names = list(dict.fromkeys(name for n in named for name in n))
    weights = [n.get(name) for n in named for name in names]
    formats = [w.named_formats().get(name, 0) for w in layers for name in names]
    return ops(isa).decoder_layers(
        x, [c for c, _ in rope], [s for _, s in rope], names, weights, formats,
        [k for k, _ in caches],
        [v for _, v in caches], [m.slot_mapping for m in metas], [m.block_tables for m in metas],
        [m.seq_lens for m in metas], [m.prefix_lens for m in metas],
        [m.cu_seqlens_q for m in metas], [m.num_decodes for m in metas],
        [m.window for m in metas], eps, offset, scale, heads, ACTIVATIONS[act], scores, froms,
        *(list(column) for column in zip(*recent_args)),
    )  # fmt: skip


def int8_peak(iterations: int = 20_000_000, isa: str | None = None) -> float:
    """Byte multiply-adds per second this machine does on torch's threads, with the multiply
    instruction the ``isa`` build's products use, from registers (no memory): their ceiling."""
    return ops(isa).int8_peak(iterations)


def usable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def takes_scores(scores: torch.Tensor) -> bool:
    """Whether the kernels add to these importance scores: float32 on the CPU, contiguous."""
    return usable(scores) and scores.is_contiguous()


def takes_cache(cache: torch.Tensor) -> bool:
    """Whether the kernels read and write this cache: ``reads_cache``, and not int4 keys, which
    are written by their groups (``kv_quant.quantize_channels``) and read by paged decode only."""
    return reads_cache(cache) and not per_channel(cache)


def reads_cache(cache: torch.Tensor) -> bool:
    """Whether paged decode reads this cache: on the CPU, in a ``kv_quant`` format, its rows
    dense and whole."""
    return (
        cache.device.type == "cpu"
        and cache.dtype in KV_DTYPES.values()
        and cache.dim() == 4
        and cache.stride(-1) == 1
        and value_dim(cache) > 0
    )


class FastLinear(nn.Module):
    """``F.linear`` over a matrix in parts (``kernels.weights.Parts``), by the kernel for
    inputs of at most ``max_rows`` rows (dense parts: F.linear above; block-format parts: the
    kernel always, as no torch op reads them).

    ``of_linear`` wraps an nn.Linear's parameters as its ``weight`` and ``bias`` (names and ties
    kept); parts of another origin are held as ``data<i>`` and ``bias<i>``: buffers, as in
    ``kernels.quant.QuantLinear``, except a tensor that is already a parameter."""

    def __init__(self, parts: Parts, max_rows: int = MAX_ROWS, names=None):
        super().__init__()
        parts = _as_parts(parts)
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a FastLinear's parts must share their input size")
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.max_rows = max_rows
        self._names = tuple(names or ((f"data{i}", f"bias{i}") for i in range(len(parts))))
        self.formats = tuple(p.format for p in parts)
        self.packed = tuple(p.packed for p in parts)
        for (data, bias), p in zip(self._names, parts):
            for name, t in ((data, p.data), (bias, p.bias)):
                if names is not None or isinstance(t, nn.Parameter):
                    setattr(self, name, t)
                else:
                    self.register_buffer(name, t)

    @classmethod
    def of_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = MAX_ROWS):
        """Over an nn.Linear's weight and bias (the same objects), or plain fused tensors."""
        return cls((Weight(weight, bias),), max_rows, names=(("weight", "bias"),))

    @property
    def parts(self) -> Parts:
        return tuple(
            Weight(getattr(self, data), getattr(self, bias), fmt, packed)
            for (data, bias), fmt, packed in zip(self._names, self.formats, self.packed)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        # No torch op reads block formats, nor 16-bit matrices times float32 inputs.
        if x.numel() <= self.max_rows * self.in_features or any(p.type_id for p in parts):
            return linear(x, parts)
        weight = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
        biases = [p.bias for p in parts]
        if all(b is None for b in biases):
            return F.linear(x, weight)
        bias = torch.cat([
            b if b is not None else x.new_zeros(p.out_features) for b, p in zip(biases, parts)
        ])  # fmt: skip
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"formats={'+'.join(self.formats)}"
        )
