"""Every engine setting, declared once: name, type, default and help.

``EngineArgs`` is the one place a setting is added. Its fields carry their command-line
description (``setting(...)``), so ``kvserve serve``, ``plan``, ``tune`` and the benchmarks
derive their flags from it (``add_cli_args``) and read them back (``from_cli_args``); nothing
lists the flags a second time. Values are checked here once, for flags and ``LLM(...)`` alike.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.core.context_overflow import (
    CONTEXT_POLICIES,
    DEFAULT_POLICY,
    SCORED_POLICIES,
    ContextOverflow,
)
from engine.core.preemption import PREEMPTION_MODES
from engine.core.speculation import SPECULATIVE_METHODS, SpeculativeConfig
from engine.kv_events import KVEventsConfig
from engine.worker.config import RunnerConfig, auto_kv_dtype, resolve_device
from kernels.backend import backend_names, default_backend
from kernels.weights import QUANTIZABLE
from models.config import ModelConfig
from models.fetch import resolve_model
from models.kv_spec import CHANNEL_GROUP, DTYPES, KV_DTYPES, int4_keys, kv_pair

ENGINE = "engine"
OVERFLOW = "overflow policies (a request may override the context one)"
SPECULATIVE = 'speculative decoding (a request may turn it off: "speculative": false)'


@dataclass(frozen=True)
class Setting:
    """How a setting appears on the command line."""

    help: str
    flag: str | None = None  # default: the field name with dashes
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    group: str = ENGINE
    exclusive: str | None = None  # settings sharing this name are mutually exclusive flags
    when_none: str | None = None  # what a None default means, for the help text


def setting(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(help, **kw)})


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user can set; the server's flags map one to one onto these fields."""

    model: str = setting(help="model folder, or an alias from `fetch`")
    dtype: str | None = setting(
        None, "weights and KV cache dtype", choices=DTYPES, when_none="float32 on CPU, "
        "bfloat16 on CUDA"
    )  # fmt: skip
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache storage (auto: float16 for a float32 model, else the model's dtype); int8 "
        "and fp8_e4m3 keep a float32 scale per token and head (a bit over a quarter of "
        "float32's bytes), int4 values a float16 scale per 32 values, int4 keys 8-bit codes "
        "of a minimum and a scale per channel and 32 tokens, quantized once those are there "
        "(about a seventh, KIVI's scheme; they keep at least 32 recent tokens, and the torch "
        "and cpu backends read them); rows per token are stored Hadamard-rotated; K/V, two of "
        "the quantized ones, stores keys in K and values in V (int8/int4, as llama.cpp's -ctk "
        "q8_0 -ctv q4_0)",
        metavar="{auto," + ",".join(KV_DTYPES) + ",K/V}",
    )
    kv_cache_dtype_skip_layers: str | None = setting(
        None,
        "layers whose cache keeps auto's dtype whatever --kv-cache-dtype says: sliding_window "
        "(a model's local layers, which hold a window's tokens only)",
        choices=("sliding_window",),
        when_none="none",
    )
    kv_cache_recent_tokens: int = setting(
        0,
        "the last N tokens of every sequence also kept in auto's dtype where the cache is "
        "quantized: attention reads a token's last N keys and values from there and only older "
        "ones quantized (int4 keys: at least 32)",
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    block_size: int = setting(
        16,
        "tokens per KV block (a power of two; at least 32 with int4 keys, which are "
        "quantized per 32 tokens)",
    )
    num_kv_blocks: int | None = setting(
        None, "KV blocks per pool (overrides --kv-cache-memory)", exclusive="kv_size",
        when_none="from --kv-cache-memory",
    )  # fmt: skip
    kv_cache_memory_gib: float | None = setting(
        None, "KV cache size in GiB", flag="--kv-cache-memory", metavar="GIB",
        exclusive="kv_size", when_none="1 GiB on CPU; on CUDA what --gpu-memory-utilization "
        "leaves after the weights and a profiled largest step",
    )  # fmt: skip
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's memory for weights, activations and the KV cache (CUDA)"
    )
    max_model_len: int | None = setting(
        None, "context limit in tokens", when_none="the model's trained context"
    )
    max_num_seqs: int = setting(64, "sequences running at once")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step")
    attention_backend: str | None = setting(
        None, "attention kernels", choices=backend_names(), when_none="by device"
    )
    quantization: str | None = setting(
        None,
        "store a float checkpoint's linear layers in a GGUF block format at load (q8_0 keeps "
        "nearly all of the quality at a quarter of float32's bytes); a GGUF file keeps its own",
        choices=QUANTIZABLE,
        when_none="as stored",
    )
    cpu_kernels: bool = setting(
        True,
        "C++ kernels for float32 on x86 CPUs with AVX2 (linear layers, decode attention, "
        "norms, rotary embedding), built on first use; off: plain torch",
    )
    repack_weights: bool = setting(
        True,
        "block-format weights rearranged once at load for the C++ kernels' products (as "
        "llama.cpp's repack; same bytes); off: read in the file's layout (llama.cpp's "
        "--no-repack)",
    )
    enable_prefix_caching: bool = setting(
        True,
        "keep and share the KV blocks of identical prompt prefixes (hashed full blocks)",
    )
    kv_host_cache_gib: float = setting(
        0.0,
        "host memory for prefix blocks the device pool evicts (written down, found and copied "
        "back up by later requests; the swap pool shares it); 0: off",
        flag="--kv-host-cache-gib",
        metavar="GIB",
    )
    kv_tier_write_through: bool = setting(
        False,
        "copy each prefix block to the host tier as soon as it is computed (SGLang's "
        "write_through), not when the device pool evicts it; needs --kv-host-cache-gib",
        flag="--kv-tier-write-through",
    )
    kv_disk_cache_dir: str | None = setting(
        None,
        "a folder for prefix blocks the host tier evicts (files that outlive a restart, in a "
        "subfolder per model and cache layout); needs --kv-host-cache-gib and "
        "--kv-disk-cache-gib",
        flag="--kv-disk-cache-dir",
        metavar="DIR",
    )
    kv_disk_cache_gib: float = setting(
        0.0,
        "the disk tier's bound: bytes of block files it keeps in --kv-disk-cache-dir, least "
        "recently used dropped first",
        flag="--kv-disk-cache-gib",
        metavar="GIB",
    )
    kv_events_config: str | None = setting(
        None,
        "publish prefix-cache events for a cluster router, as vLLM's flag: a JSON object with "
        "vLLM's keys (enable_kv_cache_events, endpoint tcp://*:5557, replay_endpoint, topic, "
        "buffer_steps, hwm, max_queue_size) and encoding (map, or array for older routers)",
        when_none="off",
    )
    enforce_eager: bool = setting(
        False, "run every step eagerly: no CUDA graphs for decode steps (CUDA only)"
    )
    seed: int = setting(0, "seed for requests that give none")
    max_grammar_compile_s: float = setting(
        5.0,
        "seconds a request's JSON schema or grammar may take to compile before it gets 400 "
        "grammar_too_complex",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks (processes) sharing each layer's attention heads and MLP, all-reducing over "
        "torch.distributed (gloo on CPU, NCCL on GPU); the heads must divide by it",
    )
    context_overflow: str = setting(
        DEFAULT_POLICY,
        "when prompt + generation reach --max-model-len: error (400), truncate the prompt, "
        "stop (finish_reason length), shift the cache (llama.cpp), sink (StreamingLLM), or "
        "evict the least important cached tokens: snapkv, h2o (attention they drew), knorm "
        "(key norm)",
        choices=CONTEXT_POLICIES,
        group=OVERFLOW,
    )
    context_n_keep: int | None = setting(
        None, "tokens kept at the start", group=OVERFLOW, when_none="4"
    )
    context_n_discard: int | None = setting(
        None, "tokens a shift discards", group=OVERFLOW, when_none="half the rest; sink: one block"
    )
    kv_budget: int = setting(
        0,
        "most tokens an importance policy (snapkv, h2o, knorm) lets one sequence cache: a "
        "longer prompt is compressed to it when its prefill ends, and decoding evicts back to "
        "it each time it has added a block; 0: no budget",
        group=OVERFLOW,
    )
    kv_scores: bool = setting(
        False,
        "keep an importance score beside each cached token (4 bytes per KV head and layer), so "
        "that requests may choose snapkv or h2o; on whenever --context-overflow is one of them",
        group=OVERFLOW,
    )
    preemption_mode: str = setting(
        "recompute",
        "how a running request gives up its KV blocks when the pool runs out",
        choices=PREEMPTION_MODES,
        group=OVERFLOW,
    )
    swap_space_gib: float = setting(
        4.0,
        "host memory for swapped-out KV blocks (with --preemption-mode swap)",
        flag="--swap-space",
        metavar="GIB",
        group=OVERFLOW,
    )
    max_overflow_tokens: int = setting(
        16384,
        "tokens a shift or sink may discard from one request over its life (about how far it "
        "generates past the context); then it finishes with 'length'",
        group=OVERFLOW,
    )
    max_queue_len: int | None = setting(
        None, "waiting requests beyond which new ones get 429", group=OVERFLOW,
        when_none="unbounded",
    )  # fmt: skip
    max_queued_tokens: int | None = setting(
        None, "waiting prompt tokens beyond which new requests get 429", group=OVERFLOW,
        when_none="unbounded",
    )  # fmt: skip

    speculative_model: str | None = setting(
        None,
        "draft model (folder, .gguf file or alias) with the target's tokenizer; drafts are "
        "verified by the target in one step, output unchanged",
        group=SPECULATIVE,
        when_none="none",
    )
    speculative_method: str | None = setting(
        None,
        "ngram: drafts from earlier occurrences of the last tokens (prompt lookup); "
        "draft_model: from --speculative-model",
        choices=SPECULATIVE_METHODS,
        group=SPECULATIVE,
        when_none="draft_model with --speculative-model, else off",
    )
    num_speculative_tokens: int | None = setting(
        None,
        "tokens drafted per step",
        group=SPECULATIVE,
        when_none="adaptive, up to 8: what measured acceptance and step costs make pay, "
        "0 where a step is compute-bound",
    )
    prompt_lookup_max: int = setting(
        4, "longest n-gram the ngram method matches", group=SPECULATIVE
    )
    prompt_lookup_min: int = setting(
        1, "shortest n-gram the ngram method matches", group=SPECULATIVE
    )

    def __post_init__(self) -> None:
        checks = [
            (_power_of_two(self.block_size), "block_size"),
            (self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks"),
            (self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0, "kv_cache_memory"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization"),
            (self.max_model_len is None or self.max_model_len > 0, "max_model_len"),
            (self.max_num_seqs > 0, "max_num_seqs"),
            (self.max_grammar_compile_s > 0, "max_grammar_compile_s"),
            (self.tensor_parallel_size > 0, "tensor_parallel_size"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens"),
            (self.dtype is None or self.dtype in DTYPES, "dtype"),
            # A pair's halves are checked by kv_pair, which says what a pair may be.
            (
                self.kv_cache_dtype == "auto" or kv_pair(self.kv_cache_dtype)[0] in KV_DTYPES,
                "kv_cache_dtype",
            ),
            (
                self.kv_cache_dtype_skip_layers in (None, "sliding_window"),
                "kv_cache_dtype_skip_layers",
            ),
            (self.kv_cache_recent_tokens >= 0, "kv_cache_recent_tokens"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device"),
            (self.attention_backend in (None, *backend_names()), "attention_backend"),
            (self.preemption_mode in PREEMPTION_MODES, "preemption_mode"),
            (self.swap_space_gib >= 0, "swap_space_gib"),
            (self.kv_host_cache_gib >= 0, "kv_host_cache_gib"),
            (self.kv_disk_cache_gib >= 0, "kv_disk_cache_gib"),
            (self.max_overflow_tokens > 0, "max_overflow_tokens"),
            (self.max_queue_len is None or self.max_queue_len > 0, "max_queue_len"),
            (self.max_queued_tokens is None or self.max_queued_tokens > 0, "max_queued_tokens"),
        ]
        for ok, name in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name, None)!r}")
        if int4_keys(self.kv_cache_dtype):
            # int4 keys are quantized per 32 tokens, which a block must hold whole: set here,
            # once, for everything that reads the block size.
            object.__setattr__(self, "block_size", max(self.block_size, CHANNEL_GROUP))
        if self.kv_cache_recent_tokens and self.scores_kept:
            raise ValueError(
                "--kv-cache-recent-tokens keeps no importance scores: it does not go with "
                "--kv-scores or an eviction policy"
            )
        self.kv_events()  # a malformed --kv-events-config is refused at start-up
        self.default_overflow()  # the one check of the three context settings
        self.speculative_config()  # and of the speculative ones

    def kv_events(self) -> KVEventsConfig | None:
        """The KV events to publish, or None."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.parse(self.kv_events_config)
        return config if config.enabled else None

    def speculative_config(self) -> SpeculativeConfig | None:
        """Speculative decoding's settings, None when it is off."""
        method = self.speculative_method
        if method is None and self.speculative_model is not None:
            method = "draft_model"
        if method is None:
            if self.num_speculative_tokens is not None:
                raise ValueError("--num-speculative-tokens needs a speculative method")
            return None
        if (method == "draft_model") != (self.speculative_model is not None):
            raise ValueError("--speculative-model goes with the draft_model method, and only there")
        return SpeculativeConfig(
            method, self.num_speculative_tokens, ngram_min=self.prompt_lookup_min,
            ngram_max=self.prompt_lookup_max,
        )  # fmt: skip

    def default_overflow(self) -> ContextOverflow:
        """The server's context-overflow choice, which a request's ``overflow`` replaces."""
        return ContextOverflow(
            self.context_overflow, self.context_n_keep, self.context_n_discard,
            self.kv_budget or None,
        )  # fmt: skip

    @property
    def scores_kept(self) -> bool:
        """Whether the cache keeps importance scores (``kv_scores``)."""
        return self.kv_scores or self.context_overflow in SCORED_POLICIES

    def runner_config(
        self, model_config: ModelConfig | None = None, eos_token_ids: tuple[int, ...] = ()
    ) -> RunnerConfig:
        """The model runner's settings, resolved once: the checkpoint's config (parsed here
        unless given), the device, the dtype and the attention backend."""
        if model_config is None:
            model_config = ModelConfig.from_dir(resolve_model(self.model))
        device = resolve_device(self.device)
        dtype = self.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        return RunnerConfig(
            model_config,
            dtype,
            str(device),
            self.attention_backend or default_backend(device, self.cpu_kernels),
            self.cpu_kernels,
            self.seed,
            self.tensor_parallel_size,
            eos_token_ids,
            self.quantization,
            self.kv_dtype(dtype),
            self.kv_cache_dtype_skip_layers == "sliding_window",
            self.kv_cache_recent_tokens,
            self.scores_kept,
            self.repack_weights,
        )

    def kv_dtype(self, dtype: str) -> str:
        """The KV cache's dtype for a model served in ``dtype`` (``--kv-cache-dtype auto``
        resolved)."""
        return auto_kv_dtype(dtype) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def _settings(cls: type = EngineArgs) -> dict[str, tuple[dataclasses.Field, Setting]]:
    return {f.name: (f, f.metadata["setting"]) for f in dataclasses.fields(cls)}


def add_cli_args(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    required: Iterable[str] = ("model",),
    cls: type = EngineArgs,
) -> None:
    """Add a flag per setting of ``cls`` (all, or ``names``), in its group; ``defaults``
    replaces the declared default of a setting for this command, ``required`` makes flags
    mandatory. Another frozen dataclass of ``setting`` fields (the server's) works the same."""
    settings = _settings(cls)
    defaults, required = dict(defaults or {}), set(required)
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for name in names or settings:
        f, s = settings[name]
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group)
        group = groups[s.group]
        if s.exclusive and name not in required:  # argparse: exclusive flags are optional
            if s.exclusive not in exclusive:
                exclusive[s.exclusive] = group.add_mutually_exclusive_group()
            group = exclusive[s.exclusive]
        default = defaults.get(name, None if f.default is dataclasses.MISSING else f.default)
        kind = dict(type=_flag_type(f.type), choices=s.choices, metavar=s.metavar)
        if f.type == "bool":  # --name / --no-name
            kind = dict(action=argparse.BooleanOptionalAction)
        elif f.type.startswith("tuple["):  # repeatable: --name A --name B
            kind = dict(action="append", type=_flag_type(f.type), metavar=s.metavar)
            default = list(default)  # argparse appends to a copy
        group.add_argument(
            s.flag or "--" + name.replace("_", "-"),
            dest=name,
            default=default,
            required=name in required,
            help=_help(s, default, name in required),
            **kind,
        )


def _flag_type(annotation: str) -> type:
    for kind in (int, float):
        if kind.__name__ in annotation.split(" | "):
            return kind
    return str


def _help(s: Setting, default: Any, required: bool) -> str:
    if required:
        return s.help
    shown = s.when_none if default is None or default == [] else default
    return f"{s.help} (default: {shown})" if shown is not None else s.help


def from_cli_args(ns: argparse.Namespace, cls: type = EngineArgs, **overrides: Any) -> Any:
    """The ``cls`` (EngineArgs) of parsed flags: settings without a flag keep their defaults;
    a repeatable flag's list becomes a tuple."""
    values = {name: getattr(ns, name) for name in _settings(cls) if hasattr(ns, name)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **overrides})
