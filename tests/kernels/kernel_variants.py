"""Every Triton kernel variant the launch code asks for, compiled ahead of time for sm_90 and
sm_80 without a GPU, with the resources each compiled kernel takes.

The launches come from the code that serves: ``forward`` and ``latent_forward`` (reached as a
model's layers reach them, by ``kernels.paged.ForwardContext``, with the layer's rotary), the
norms and activation of a layer around them, and ``rotate_keys`` of the ``triton`` backend,
whose ``run`` records each launch instead of running it, on meta tensors shaped as a model's
steps are (its KV-cache groups from ``models``). A launch becomes a variant the way Triton's JIT
makes one: the constexprs plus the specialization Triton derives from the arguments (integers
equal to 1 or divisible by 16, pointers aligned to 16 bytes). Each distinct variant is compiled
once with ``triton.compile`` for the target; its cubin's resource usage (``cuobjdump``) gives
registers, static shared memory and the stack frame, where spilled registers go; Triton's
metadata gives the dynamic shared memory.

The block-format kernels (``kernels.triton_quant``) are reached the same way: the ``triton``
backend's ``prepare`` swaps the ``QuantLinear`` and ``QuantEmbedding`` modules of a quantized
model (``QUANT_MODELS``: each matrix's parts and formats as its GGUF file stores them) for its
own, which are then called on meta tensors of every step size; in their rows, ``group`` names
the matrix part a launch reads and its format (``down:q6_k``), not a KV-cache group.

Every step of a full-attention group is recorded twice: as it is, and keeping importance scores
(``AttentionMetadata.score_from``, a scores tensor beside the cache, as ``--kv-scores`` serves;
sliding-window groups keep none), which adds the decode and prefill scoring kernels.

A cache holds its model's dtype (``DTYPES``), or one of the quantized KV dtypes (``KV_DTYPES``:
int8, fp8_e4m3, int4, laid out as ``kernels.kv_quant`` says) under a bf16 model; those steps
are recorded for a model of each layout (``KV_MODELS``). A row's ``kv`` names its cache dtype.

Run as a module, in a process without ``TRITON_INTERPRET`` (the kernels must be JIT functions):
it prints one JSON document, ``{"skip": reason}`` or ``{"rows": [...]}`` with one row per
(model, dtype, KV dtype, target, KV-cache group, kernel, variant).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import torch

BLOCK_SIZE = 16  # the engine's default (engine/args.py)


@dataclass(frozen=True)
class Target:
    """A GPU generation: compute capability, multiprocessors (for the decode split plan) and the
    most shared memory one block may opt in to (CUDA C++ Programming Guide, table of technical
    specifications per compute capability: 227 KB on 9.0, 163 KB on 8.0)."""

    capability: int
    sms: int
    max_shared: int


TARGETS = {
    "sm_90": Target(90, sms=132, max_shared=232_448),  # H100 SXM
    "sm_80": Target(80, sms=108, max_shared=166_912),  # A100
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Quantized KV dtypes, each compiled under a bf16 model of every layout: GQA with heads of 64
# and 128 values, Gemma 3's window ring (256), DeepSeek's MLA latents (576, values their 512).
KV_DTYPES = ("int8", "fp8_e4m3", "int4")
KV_MODEL_DTYPE = "bf16"
KV_MODELS = ("SmolLM2-135M", "Llama-3-8B", "Gemma-3-270M", "DeepSeek-V3")
# Keys and values in two quantized dtypes (an MLA cache has one): int8 keys beside int4 values
# read by one kernel, at head sizes 128 and Gemma 3's 256 (with its window ring); and with the
# last tokens kept beside them (``kernels.triton_attention.recent``: a shifted prefill, and
# decodes in one split that keep their log-sum-exps).
KV_PAIRS = ("int8/int4", "int8/int4+128")  # the second with 128 recent tokens in bf16
KV_PAIR_MODELS = ("Llama-3-8B", "Gemma-3-270M")

# The config.json fields of the published checkpoints that shape attention, the cache and the
# kernels of a layer around them (norms, the MLP's activation).
MODELS = {
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "intermediate_size": 1536,
    },
    "Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
        "intermediate_size": 14336,
    },
    "Gemma-3-270M": {
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
        "intermediate_size": 2048, "hidden_activation": "gelu_pytorch_tanh",
    },
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840,
        "q_lora_rank": 1536, "intermediate_size": 18432,
    },
}  # fmt: skip

# Quantized models as their Q4_K_M GGUF files store them (llama.cpp's recipe): most matrices in
# q4_k, v and down in q6_k in some layers; where a matrix's input width is not a multiple of 256
# (0.5B's 896) q4_k falls back to q5_0 and q6_k to q8_0. Fused matrices are parts stacked by
# rows (``kernels.weights.Parts``); each entry of a slot is one way a layer stores it, as
# ((format, rows), ...). The embedding table is the LM head too (tied).
QUANT_MODELS = {
    "Qwen2.5-Coder-0.5B-Q4_K_M": {
        "hidden": 896, "intermediate": 4864, "vocab": 151936, "table": "q8_0",
        "qkv": ((("q5_0", 1152),), (("q5_0", 1024), ("q8_0", 128))),
        # A float matrix beside them: files may keep one in F16 or F32, served as float rows.
        "o": ((("q5_0", 896),), (("dense", 896),)),
        "gate_up": ((("q5_0", 9728),),),
        "down": ((("q4_k", 896),), (("q6_k", 896),)),
    },
    "Qwen2.5-Coder-1.5B-Q4_K_M": {
        "hidden": 1536, "intermediate": 8960, "vocab": 151936, "table": "q6_k",
        "qkv": ((("q4_k", 1792), ("q4_k", 256)), (("q4_k", 1792), ("q6_k", 256))),
        "o": ((("q4_k", 1536),),),
        "gate_up": ((("q4_k", 17920),),),
        "down": ((("q4_k", 1536),), (("q6_k", 1536),)),
    },
}  # fmt: skip
QUANT_ROWS = (1, 2, 3, 4, 5, 16, 17, 64, 65, 256, 2048)  # tokens of a step, or its sequences

# Steps the launch code could tell apart: batch sizes and table widths around 1 and multiples
# of 16, decodes before prefills in odd and even numbers (the prefill part is a slice).
BATCHES = (1, 2, 3, 4, 16, 17, 64, 256)
CONTEXTS = (1, 15, 16, 17, 100, 1024, 4097, 32768)
MIXED = ((0, 1), (1, 1), (2, 3), (3, 2), (4, 1), (5, 17), (16, 16))  # (decodes, prefills)
CHUNKS = ((0, 1), (0, 15), (13, 16), (100, 256), (4000, 2048))  # (prefix, new tokens)


@dataclass(frozen=True)
class Step:
    """One engine step: contexts of the decodes, (prefix, new tokens) of the prefills."""

    decodes: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]

    @property
    def seq_lens(self) -> list[int]:
        return list(self.decodes) + [p + n for p, n in self.prefills]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


def kv_name(dtype: torch.dtype) -> str:
    """A float dtype's name as a KV dtype (``kernels.kv_quant.KV_DTYPES``)."""
    return str(dtype).removeprefix("torch.")


def model_config(name: str, **overrides):
    from models.config import ModelConfig

    return ModelConfig(Path(name), MappingProxyType({**MODELS[name], **overrides}))


def steps(max_len: int) -> Iterator[Step]:
    for batch in BATCHES:
        for context in CONTEXTS:
            if context <= max_len:
                yield Step((context,) * batch, ())
    for i, (decodes, prefills) in enumerate(MIXED):
        for j, (prefix, new) in enumerate(CHUNKS):
            context = CONTEXTS[(i + j) % len(CONTEXTS)]
            yield Step((min(context, max_len),) * decodes, ((prefix, new),) * prefills)


def _metadata(step: Step, width: int, window: int, scored: bool = False):
    from kernels.backend import AttentionMetadata

    batch = len(step.seq_lens)
    meta = dict(dtype=torch.int32, device="meta")
    return AttentionMetadata(
        slot_mapping=torch.empty(step.num_tokens, dtype=torch.int64, device="meta"),
        block_tables=torch.empty(batch, width, **meta),
        seq_lens=torch.empty(batch, **meta),
        prefix_lens=torch.empty(batch, **meta),
        cu_seqlens_q=torch.empty(batch + 1, **meta),
        num_decodes=len(step.decodes),
        window=window,
        score_from=torch.empty(batch, **meta) if scored else None,
    )


def _layer_tensors(
    spec, num_heads: int, tokens: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE
):
    """The per-layer caches as the model runner allocates them for ``kv_spec`` (in its dtype;
    two blocks: the block count changes no stride), and q, k, v of ``tokens`` new tokens as
    the models hand them to attention (in ``dtype``)."""
    from kernels.kv_quant import KV_DTYPES as CACHE_DTYPES
    from models.kv_spec import MLASpec, kv_pair, row_bytes

    new = dict(dtype=dtype, device="meta")
    keys, values = kv_pair(spec.dtype)

    def cache(kv: str, dim: int, heads: int) -> torch.Tensor:
        row = row_bytes(kv, dim) // CACHE_DTYPES[kv].itemsize
        return torch.empty(2, block_size, heads, row, dtype=CACHE_DTYPES[kv], device="meta")

    if isinstance(spec, MLASpec):
        dk, dv, heads = spec.row_width, spec.kv_lora_rank, 1
    else:
        dk, dv, heads = spec.head_dim, spec.head_dim, spec.num_kv_heads
    k_cache = cache(keys, dk, heads)
    k = torch.empty(tokens, heads, dk, **new)
    if isinstance(spec, MLASpec):
        v_cache, v = k_cache[..., : row_bytes(keys, dv) // k_cache.itemsize], k[..., :dv]
    else:
        v_cache, v = cache(values, dv, heads), torch.empty(tokens, heads, dv, **new)
    return (k_cache, v_cache), (torch.empty(tokens, num_heads, dk, **new), k, v)


def _attend(ctx, cfg, spec, tokens: int, dtype: torch.dtype) -> None:
    """Layer 0's attention over the step, its inputs as the model's layer makes them: views of
    the fused projections' outputs, turned by the layer's rotary."""
    from kernels.backend import LatentRotary, Rotary
    from models.kv_spec import MLASpec

    new = dict(dtype=dtype, device="meta")
    heads = cfg.num_heads
    if isinstance(spec, MLASpec):
        rank, rope, nope = spec.kv_lora_rank, spec.qk_rope_head_dim, cfg.hf["qk_nope_head_dim"]
        q_pe = torch.empty(tokens, heads, nope + rope, **new)[..., nope:]
        qkv_a = torch.empty(tokens, cfg.hf["q_lora_rank"] + rank + rope, **new)
        c_kv, k_pe = qkv_a[:, -rank - rope :].split([rank, rope], -1)
        cos = torch.empty(tokens, rope // 2, **new)
        rotary = LatentRotary(cos, cos, True, (torch.empty(rank, **new), 1e-6))
        q_latent = torch.empty(tokens, heads, rank, **new)
        ctx.latent_attention(0, q_latent, q_pe, c_kv, k_pe, 0.1, rotary)
        return
    d, kv_heads = spec.head_dim, spec.num_kv_heads
    qkv = torch.empty(tokens, (heads + 2 * kv_heads) * d, **new)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    cos = torch.empty(tokens, d, **new)
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    norms = (torch.empty(d, **new), torch.empty(d, **new), 1e-6, 1.0) if gemma else None
    q, k, v = (x.view(tokens, -1, d) for x in (q, k, v))
    ctx.attention(0, q, k, v, 0.1, Rotary(cos, cos, None, norms))


def record_layer_launches(name: str, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """(what the kernel serves, launch) of the kernels of a layer around attention, as the
    model's modules call the ``triton`` backend: the norms (each with its residual add, Gemma's
    with the sublayer's norm first; MLA's query LoRA's), the MLP's activation."""
    from kernels.backend import TritonBackend

    cfg = model_config(name)
    launches: list = []
    backend = TritonBackend(run=launches.append)
    new = dict(dtype=dtype, device="meta")
    hidden, inter = cfg.hidden_size, cfg.hf["intermediate_size"]
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    offset = 1.0 if gemma else 0.0
    for tokens in (1, 64):
        x, weight = torch.empty(tokens, hidden, **new), torch.empty(hidden, **new)
        backend.rms_norm(x, weight, 1e-6, offset)
        backend.add_rms_norm(x, x, weight, 1e-6, offset, weight if gemma else None)
        yield from (("hidden", launch) for launch in launches)
        launches.clear()
        if cfg.get("q_lora_rank"):
            rank = cfg.hf["q_lora_rank"]
            backend.rms_norm(torch.empty(tokens, rank, **new), torch.empty(rank, **new), 1e-6, 0)
            yield from (("q_lora", launch) for launch in launches)
            launches.clear()
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        backend.act_mul(torch.empty(tokens, 2 * inter, **new), act)
        yield from (("mlp", launch) for launch in launches)
        launches.clear()


def _rope_layout(spec):
    """Where the rotary part of a cached row is (``cached_key_rope`` of the models)."""
    from kernels.rotary import RopeLayout
    from models.kv_spec import MLASpec

    if isinstance(spec, MLASpec):
        return RopeLayout(torch.empty(spec.qk_rope_head_dim // 2), start=spec.kv_lora_rank)
    return RopeLayout(torch.empty(spec.head_dim // 2))


def record_launches(
    name: str, dtype: torch.dtype, sms: int, kv: str = ""
) -> Iterator[tuple[int, object]]:
    """(KV-cache group, launch) of every step of the model, through the serving code path, its
    caches in the KV dtype ``kv`` ("": the model's; ``DTYPE+N``: with its last N tokens also
    in recent rows of the model's dtype, ``models.kv_spec.with_recent``)."""
    from kernels.backend import TritonBackend
    from kernels.paged import ForwardContext
    from models.kv_spec import SlidingWindowSpec
    from models.loader import model_class

    cfg = model_config(name)
    kv, _, recent = kv.partition("+")
    groups = model_class(cfg).kv_cache_groups(cfg, kv or kv_name(dtype))
    launches: list = []
    backend = TritonBackend(run=launches.append, sms=sms)
    for g, group in enumerate(groups):
        spec = group.spec
        ring = recent and SlidingWindowSpec(spec.num_kv_heads, spec.head_dim, kv_name(dtype),
                                            window_size=int(recent))  # fmt: skip
        for step in steps(cfg.max_position_embeddings):
            # As the model runner builds tables: as wide as the longest sequence needs.
            width = spec.table_width(max(step.seq_lens), BLOCK_SIZE)
            caches, _ = _layer_tensors(spec, cfg.num_heads, step.num_tokens, dtype)
            for scored in (False, True) if spec.window == 0 and not ring else (False,):
                meta = _metadata(step, width, spec.window, scored)
                planes = torch.empty(caches[0].shape[:3], dtype=torch.float32, device="meta")
                scores = planes if scored else None
                if ring:  # layer 1 holds layer 0's recent rows
                    ring_width = ring.table_width(max(step.seq_lens), BLOCK_SIZE)
                    metas = [meta, _metadata(step, ring_width, ring.window)]
                    ring_caches, _ = _layer_tensors(ring, cfg.num_heads, step.num_tokens, dtype)
                    ctx = ForwardContext.planned(backend, metas, [caches, ring_caches], (0, 1),
                                                 recent_layers=1)  # fmt: skip
                else:
                    ctx = ForwardContext.planned(backend, [meta], [caches], (0,), [scores])
                _attend(ctx, cfg, spec, step.num_tokens, dtype)
        for blocks in (1, 3, 17):  # a context shift re-rotates whole blocks
            ids = torch.empty(blocks, dtype=torch.int64, device="meta")
            backend.rotate_keys(caches[0], ids, -37, _rope_layout(spec))
        yield from ((g, launch) for launch in launches)
        launches.clear()


def _quant_weight(fmt: str, rows: int, cols: int, dtype: torch.dtype, bias: bool):
    from kernels.weights import FORMATS, Weight

    spec = FORMATS[fmt]
    if fmt == "dense":
        data = torch.empty(rows, cols, dtype=dtype, device="meta")
    else:
        data = torch.empty(
            rows, cols // spec.block * spec.block_bytes, dtype=torch.uint8, device="meta"
        )
    return Weight(data, torch.empty(rows, dtype=dtype, device="meta") if bias else None, fmt)


def _quant_modules(name: str, dtype: torch.dtype):
    """(labels of its parts, module) of every distinct stored matrix of the model, as
    ``kernels.quant`` modules: the table as embedding and LM head, and every way a layer stores
    each projection (q, k and v with their biases, as Qwen2's)."""
    from kernels.quant import QuantEmbedding, QuantLinear
    from kernels.weights import part_name

    m = QUANT_MODELS[name]
    table = _quant_weight(m["table"], m["vocab"], m["hidden"], dtype, bias=False)
    yield (f"embedding:{table.format}",), QuantEmbedding(table, dtype)
    yield (f"lm_head:{table.format}",), QuantLinear((table,))
    for slot in ("qkv", "o", "gate_up", "down"):
        cols = m["intermediate"] if slot == "down" else m["hidden"]
        for stored in m[slot]:
            parts = tuple(
                _quant_weight(fmt, rows, cols, dtype, bias=slot == "qkv") for fmt, rows in stored
            )
            labels = tuple(f"{part_name(slot, i)}:{p.format}" for i, p in enumerate(parts))
            yield labels, QuantLinear(parts)


def record_quant_launches(name: str, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """(part and format, launch) of every step size, through the ``triton`` backend's modules."""
    from kernels.backend import TritonBackend
    from kernels.quant import QuantEmbedding

    launches: list = []
    labels, modules = zip(*_quant_modules(name, dtype))
    model = torch.nn.ModuleList(modules)
    assert TritonBackend(run=launches.append).prepare(model) == len(model)
    for parts, module in zip(labels, model):
        for rows in QUANT_ROWS:
            if isinstance(module, QuantEmbedding):
                module(torch.empty(rows, dtype=torch.int64, device="meta"))
            else:
                module(torch.empty(rows, module.in_features, dtype=dtype, device="meta"))
            assert len(launches) == len(parts)  # one per part
            yield from zip(parts, launches)
            launches.clear()


@dataclass(frozen=True)
class Variant:
    """What Triton compiles for a launch: the ``triton.compile`` inputs, and a key for them."""

    kernel: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def key(self) -> str:
        parts = (self.signature, sorted(self.constexprs.items()), self.attrs, self.options)
        return f"{self.kernel.__name__}:" + repr(parts)


@dataclass(frozen=True)
class Resources:
    shared: int  # bytes per block: Triton's dynamic shared memory plus the cubin's static
    registers: int  # per thread
    stack: int  # stack frame bytes per thread: where ptxas puts the registers it spills
    async_copies: int  # cp.async instructions in the PTX: global loads copied to shared memory
    in_flight: int  # most copy groups a cp.async.wait_group leaves outstanding (0: none)
    wide_loads: int  # global loads of 16 bytes a thread (ld.global.v4.b32) in the PTX


def _async_copies(ptx: str) -> tuple[int, int]:
    """(cp.async copies, the most groups any ``cp.async.wait_group N`` leaves in flight).

    Triton's pipeliner issues a loop's copies ``num_stages - 1`` tiles ahead. With 2 stages the
    loop waits for all of them (N = 0) before it computes; N >= 1 means a tile's copy is still
    under way while the loop computes on the one before it."""
    copies = len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global\b", ptx))
    waits = [int(n) for n in re.findall(r"\bcp\.async\.wait_group\s+(\d+)\s*;", ptx)]
    return copies, max(waits, default=0)


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """The counters ``cuobjdump --dump-resource-usage`` reports for the cubin's one kernel."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


class Specializer:
    """Launch -> Variant for one target, as ``JITFunction.run`` does at a launch; Variant ->
    Resources by compiling it for the target."""

    def __init__(self, capability: int) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", capability, 32)
        self.backend = make_backend(self.target)
        self._binders: dict = {}

    def variant(self, launch) -> Variant:
        from triton.runtime.jit import create_function_from_signature

        kernel = launch.kernel
        if kernel not in self._binders:
            self._binders[kernel] = create_function_from_signature(
                kernel.signature, kernel.params, self.backend
            )
        bound, specialization, options = self._binders[kernel](*launch.args, **launch.params)
        options, signature, constexprs, attrs = kernel._pack_args(
            self.backend, dict(launch.params), bound, specialization, options
        )
        return Variant(kernel, signature, constexprs, attrs, options.__dict__)

    def compiled(self, variant: Variant):
        """Triton's compiled kernel (``asm`` holds its TTGIR, PTX and cubin)."""
        import triton
        from triton.compiler import ASTSource

        source = ASTSource(variant.kernel, variant.signature, variant.constexprs, variant.attrs)
        return triton.compile(source, target=self.target, options=variant.options)

    def compile(self, variant: Variant) -> Resources:
        compiled = self.compiled(variant)
        used = _resource_usage(compiled.asm["cubin"])
        ptx = compiled.asm["ptx"]
        copies, in_flight = _async_copies(ptx)
        wide = len(re.findall(r"\bld\.global(?:\.[\w:]+)*\.v4\.b32\b", ptx))
        return Resources(
            compiled.metadata.shared + used["SHARED"], used["REG"], used["STACK"], copies,
            in_flight, wide,
        )  # fmt: skip


def unavailable() -> str | None:
    """Why variants cannot be compiled in this process, or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the kernels are interpreted, not compiled"
    try:
        import triton
        from triton import knobs
        from triton.backends import backends
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    if "nvidia" not in backends:
        return "triton has no NVIDIA backend"
    for tool in ("ptxas", "ptxas_blackwell", "cuobjdump"):  # ptxas below sm_90, the other above
        try:
            getattr(knobs.nvidia, tool)
        except RuntimeError as e:
            return f"triton's NVIDIA tools are incomplete: {e}"
    from triton.runtime import jit

    # Specializer goes through these, as JITFunction.run does (Triton 3.x internals).
    if not hasattr(jit, "create_function_from_signature") or not hasattr(
        jit.JITFunction, "_pack_args"
    ):
        return f"triton {triton.__version__} specializes launches differently than expected"
    return None


def _variant_id(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:10]


def _recordings(target: Target) -> Iterator[tuple[str, str, str, Iterator]]:
    """(model, dtype, KV dtype, its launches) of every recorded configuration: the attention
    models with caches in their own dtype and in each quantized one, the quantized models'
    matrices (no cache: KV dtype "")."""
    for model in (*MODELS, *QUANT_MODELS):
        for dtype_name, dtype in DTYPES.items():
            if model in MODELS:
                launches = itertools.chain(
                    record_launches(model, dtype, target.sms), record_layer_launches(model, dtype)
                )
                yield model, dtype_name, kv_name(dtype), launches
            else:
                yield model, dtype_name, "", record_quant_launches(model, dtype)
    dtype = DTYPES[KV_MODEL_DTYPE]
    for model in KV_MODELS:
        for kv in KV_DTYPES:
            yield model, KV_MODEL_DTYPE, kv, record_launches(model, dtype, target.sms, kv)
    for model in KV_PAIR_MODELS:
        for kv in KV_PAIRS:
            yield model, KV_MODEL_DTYPE, kv, record_launches(model, dtype, target.sms, kv)


def collect(target_name: str) -> list[dict]:
    """One row per (model, dtype, KV dtype, KV-cache group or quantized part, kernel, variant)
    for the target, with its launch count and the compiled variant's resources."""
    target = TARGETS[target_name]
    specializer = Specializer(target.capability)
    counts: dict[tuple, int] = {}
    variants: dict[str, Variant] = {}
    for model, dtype_name, kv, launches in _recordings(target):
        for group, launch in launches:
            variant = specializer.variant(launch)
            row = (model, dtype_name, kv, group, variant.kernel.__name__, variant.key)
            counts[row] = counts.get(row, 0) + 1
            variants[variant.key] = variant
    resources = {key: specializer.compile(v) for key, v in variants.items()}
    return [
        dict(
            model=model, dtype=dtype, kv=kv, target=target_name, group=group, kernel=kernel,
            variant=_variant_id(key), launches=launches, max_shared=target.max_shared,
            num_stages=variants[key].options["num_stages"], params=_params(variants[key]),
            **asdict(resources[key]),
        )
        for (model, dtype, kv, group, kernel, key), launches in counts.items()
    ]  # fmt: skip


def _params(variant: Variant) -> dict:
    """The variant's constexprs by name (numbers, flags and strings: what JSON carries)."""
    names = variant.kernel.arg_names
    return {names[at[0]]: v for at, v in variant.constexprs.items() if isinstance(v, (int, str))}


def config(row: dict) -> str:
    """What a row was compiled for: its dtype, or the quantized KV dtype under it."""
    return row["kv"] if row["kv"] in (*KV_DTYPES, *KV_PAIRS) else row["dtype"]


def table(rows: list[dict]) -> str:
    """Markdown: per model, target and kernel (and all kernels together), the variants per dtype
    (and per quantized KV dtype, under the bf16 model) and the largest shared memory, registers
    and stack frame among them."""
    configs = (*DTYPES, *KV_DTYPES, *KV_PAIRS)
    lines = [
        f"| model | target | kernel | variants {'/'.join(configs)} | max shared B (limit) "
        "| max registers | max stack B |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        # The test's rows name the triton that compiled them: another than the current one
        # goes beside the target.
        where = r["target"] if r.get("triton", "current") == "current" else (
            f"{r['target']} triton {r['triton']}")  # fmt: skip
        for kernel in (r["kernel"].strip("_"), "all"):
            groups.setdefault((r["model"], where, kernel), []).append(r)
    for (model, target, kernel), mine in sorted(groups.items()):
        counts = "/".join(
            str(len({(r["group"], r["kernel"], r["variant"]) for r in mine if config(r) == c}))
            for c in configs
        )
        worst = {k: max(r[k] for r in mine) for k in ("shared", "registers", "stack")}
        lines.append(
            f"| {model} | {target} | {kernel} | {counts} "
            f"| {worst['shared']:,} ({mine[0]['max_shared']:,}) | {worst['registers']} "
            f"| {worst['stack']} |"
        )
    return "\n".join(lines)


def ptxas_verbose(ptx: str, capability: int) -> dict[str, int]:
    """``ptxas -v`` of Triton's PTX with the ptxas and flags Triton's NVIDIA backend uses
    (``make_cubin``): registers, spill store and load bytes, stack frame bytes."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        command = [
            get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o", f"{src}.o",
        ]  # fmt: skip
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    found = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    return {k: int(re.search(pattern, log).group(1)) for k, pattern in found.items()}


def _tile_launch(
    model: str,
    kernel: str,
    dtype: torch.dtype,
    tile,
    sms: int,
    block_size: int,
    heads: int,
    kv: str = "",
):
    """The decode or prefill launch of the model's first KV-cache group with ``tile`` (and
    ``heads`` query heads, if not 0), its cache in the KV dtype ``kv`` ("": the model's)."""
    from kernels import triton_attention
    from models.loader import model_class

    cfg = model_config(model, **({"num_attention_heads": heads} if heads else {}))
    spec = model_class(cfg).kv_cache_groups(cfg, kv or kv_name(dtype))[0].spec
    (k_cache, v_cache), (q, k, v) = _layer_tensors(spec, cfg.num_heads, 4, dtype, block_size)
    index = dict(dtype=torch.int32, device="meta")
    tables, lens = torch.empty(4, 8, **index), torch.empty(4, **index)
    if kernel == "decode":
        _, launches = triton_attention.decode_launches(
            q, k_cache, v_cache, tables, lens, 0.1, spec.window, tile=tile, sms=sms
        )
    else:
        cu = torch.empty(5, **index)
        _, launches = triton_attention.prefill_launches(
            q, k, v, k_cache, v_cache, tables, cu, lens, 0.1, spec.window, tile=tile
        )
        launches = launches[-1:]  # after those that quantize the chunk's own rows
    return launches[0]


def tile_usage(
    target_name: str,
    model: str,
    kernel: str,
    dtype_name: str,
    tiles: list,
    block_size: int = BLOCK_SIZE,
    heads: int = 0,
    kv: str = "",
) -> str:
    """Markdown: for each tile, the model's decode or prefill kernel compiled for the target
    (over a cache of KV dtype ``kv``, "": the model's), with ``ptxas -v``'s registers and
    spills, the shared memory and the async copies."""
    target = TARGETS[target_name]
    specializer = Specializer(target.capability)
    lines = [
        "| heads/rows | keys/step | warps | stages | registers | spill stores/loads B "
        "| stack B | shared B (limit) | cp.async | in flight |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tile in tiles:
        dtype = DTYPES[dtype_name]
        launch = _tile_launch(model, kernel, dtype, tile, target.sms, block_size, heads, kv)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # Triton prints failing PTX there
                compiled = specializer.compiled(specializer.variant(launch))
        except Exception as e:  # ptxas refuses a tile whose instructions need more registers
            why = next((x for x in str(e).splitlines() if "fatal" in x), str(e).splitlines()[0])
            why = re.sub(r"^.*?fatal\s*:\s*(\(\w+\)\s*)?", "", why).strip()
            lines.append(
                f"| {tile.rows} | {tile.block_n} | {tile.num_warps} | {tile.num_stages} "
                f"| does not compile: {why} |||||"
            )
            continue
        v = ptxas_verbose(compiled.asm["ptx"], target.capability)
        shared = compiled.metadata.shared + _resource_usage(compiled.asm["cubin"])["SHARED"]
        copies, in_flight = _async_copies(compiled.asm["ptx"])
        lines.append(
            f"| {tile.rows} | {tile.block_n} | {tile.num_warps} | {tile.num_stages} "
            f"| {v['registers']} | {v['spill_stores']}/{v['spill_loads']} | {v['stack']} "
            f"| {shared:,} ({target.max_shared:,}) | {copies} | {in_flight} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m tests.kernels.kernel_variants TARGET`` (a key of TARGETS): every variant,
    as JSON. ``... TARGET --tiles MODEL decode|prefill DTYPE ROWS:KEYS:WARPS:STAGES ...``: the
    model's kernel compiled with each tile, as a markdown table (``ptxas -v`` figures), its
    cache in blocks of ``--block-size`` tokens, in the KV dtype ``--kv`` (default the
    model's)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.kernels.kernel_variants")
    parser.add_argument("target", choices=TARGETS)
    parser.add_argument("--tiles", nargs="+", metavar="ARG")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="with --tiles")
    parser.add_argument(
        "--heads", type=int, default=0, help="with --tiles: query heads (MLA: a rank's share)"
    )
    parser.add_argument("--kv", choices=KV_DTYPES, default="", help="with --tiles")
    args = parser.parse_args(argv)
    why = unavailable()
    if args.tiles:
        if why:
            sys.exit(why)
        from kernels.triton_attention import Tile

        model, kernel, dtype_name, *specs = args.tiles
        tiles = [Tile(*map(int, spec.split(":"))) for spec in specs]
        usage = tile_usage(
            args.target, model, kernel, dtype_name, tiles, args.block_size, args.heads, args.kv
        )
        print(usage)
        return
    print(json.dumps({"skip": why} if why else {"rows": collect(args.target)}))


if __name__ == "__main__":
    main(sys.argv[1:])
