"""Engine configuration: frozen dataclasses built once from flags; derived values are properties."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.overflow import CONTEXT_POLICIES, PREEMPTION_MODES


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """A checkpoint's config.json, with the fields every model reads as properties."""

    path: Path
    hf: MappingProxyType

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        with open(path / "config.json") as f:
            raw = json.load(f)
        text = raw.get("text_config")
        if isinstance(text, dict) and "architectures" not in raw:
            raw = {**text, "architectures": raw.get("architectures")}
        return cls(path, MappingProxyType(raw))

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        if not archs:
            raise ValueError(f"{self.path}/config.json names no architecture")
        return archs[0]

    @property
    def vocab_size(self) -> int:
        return self.hf["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.hf["hidden_size"]

    @property
    def num_layers(self) -> int:
        return self.hf["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.hf["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.get("max_position_embeddings", 2048)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: tuple[int, ...]  # one pool per KV-cache group
    dtype: str


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"  # or "swap"


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user can set; the server's flags map one to one onto these fields."""

    model: str
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # per KV-cache group; overrides kv_cache_memory_gib
    kv_cache_memory_gib: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    max_model_len: int | None = None  # None: the model's trained context
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention_backend: str | None = None  # None: by device
    seed: int = 0
    # Overflow policies (engine.overflow): the context default, which requests may override.
    context_overflow: str = "error"  # error, truncate, stop, shift, sink
    context_n_keep: int | None = None
    context_n_discard: int | None = None
    preemption_mode: str = "recompute"  # or "swap", to a host pool of swap_space_gib
    swap_space_gib: float = 4.0
    max_queue_len: int | None = None  # waiting requests beyond which new ones get a 429
    max_queued_tokens: int | None = None  # waiting prompt tokens, likewise

    def __post_init__(self) -> None:
        checks = [
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size"),
            (self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks"),
            (self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0, "kv_cache_memory"),
            (self.max_model_len is None or self.max_model_len > 0, "max_model_len"),
            (self.max_num_seqs > 0, "max_num_seqs"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device"),
            (self.context_overflow in CONTEXT_POLICIES, "context_overflow"),
            (self.context_n_keep is None or self.context_n_keep >= -1, "context_n_keep"),
            (self.context_n_discard is None or self.context_n_discard > 0, "context_n_discard"),
            (self.preemption_mode in PREEMPTION_MODES, "preemption_mode"),
            (self.swap_space_gib >= 0, "swap_space_gib"),
            (self.max_queue_len is None or self.max_queue_len > 0, "max_queue_len"),
            (self.max_queued_tokens is None or self.max_queued_tokens > 0, "max_queued_tokens"),
        ]
        for ok, name in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name, None)!r}")
