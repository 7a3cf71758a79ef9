"""What a model runner is built from: one small frozen ``RunnerConfig``, made once by the
engine from its settings (``EngineArgs.runner_config``) with everything resolved (the model's
config, dtype, device, attention backend), and sent as it is to tensor-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.interface import CausalLM
from models.kv_spec import CHANNEL_GROUP, KVCacheGroup, channel_keys, sliding_window_in, with_recent


@dataclass(frozen=True)
class RunnerConfig:
    model_config: ModelConfig  # parsed from the checkpoint folder (``model_config.path``)
    dtype: str  # "float32", "bfloat16", "float16"
    device: str  # resolved: "cpu", "cuda", "cuda:1"
    attention_backend: str  # a name of ``kernels.backend.BACKENDS``
    cpu_kernels: bool  # whether a float32 CPU model may run on ``kernels.cpu``
    seed: int = 0
    tensor_parallel_size: int = 1
    eos_token_ids: tuple[int, ...] = ()
    quantization: str | None = None  # a block format for a float checkpoint's linear layers
    kv_cache_dtype: str = ""  # a ``KV_DTYPES`` or a ``kv_pair``; "": the model's dtype
    kv_skip_sliding: bool = False  # sliding-window layers' caches in ``auto_kv_dtype(dtype)``
    kv_recent_tokens: int = 0  # the last ones of quantized groups also in auto's (``with_recent``)
    kv_scores: bool = False  # importance scores beside the cache (``KVCacheGroup.scored``)
    repack_weights: bool = True  # block-format weights repacked for ``kernels.cpu``

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def kv_cache_groups(self, model: type[CausalLM], config: ModelConfig) -> list[KVCacheGroup]:
        """The model's cache groups in the dtypes these settings give them, and the groups of
        their recent tokens."""
        return cache_groups(model, config, self.kv_dtype, self.dtype, self.kv_skip_sliding,
                            self.kv_recent_tokens)  # fmt: skip

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA where there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def auto_kv_dtype(dtype: str) -> str:
    """``--kv-cache-dtype auto``: float16 for a float32 model (measured on Qwen2.5-Coder-0.5B:
    mean KL divergence 2.4e-6 from float32 keys and values, bench/results/kv-cache-*.md, at
    half the bytes), else the model's dtype."""
    return "float16" if dtype == "float32" else dtype


def cache_groups(
    model: type[CausalLM],
    config: ModelConfig,
    kv_dtype: str,
    dtype: str,
    skip_sliding: bool = False,
    recent_tokens: int = 0,
) -> list[KVCacheGroup]:
    """A model's cache groups in ``kv_dtype``: its sliding-window ones in ``auto_kv_dtype``'s
    where ``skip_sliding``, and with ``recent_tokens`` (at least 32 where keys are int4) the
    groups of their last tokens in it (``models.kv_spec.with_recent``); ``dtype`` the
    model's."""
    groups = model.kv_cache_groups(config, kv_dtype)
    if skip_sliding:
        groups = sliding_window_in(groups, auto_kv_dtype(dtype))
    if any(channel_keys(g.spec) for g in groups):
        # A group of int4 keys is quantized once its 32 tokens are there: until then, and
        # while a row may still read them, attention finds them among the recent rows.
        recent_tokens = max(recent_tokens, CHANNEL_GROUP)
    if recent_tokens:
        groups = with_recent(groups, config.num_layers, recent_tokens, auto_kv_dtype(dtype))
    return groups
