"""The engine, in two rooms and the hub between them.

- ``engine.core``: pure Python, no torch: requests and their queue, the scheduler, the KV
  manager (one table manager per cache spec) over block pools, the overflow and preemption
  policies, sampling parameters and the plain outputs.
- ``engine.worker``: everything that touches tensors: the model runner and its step inputs,
  CUDA graphs, tensor-parallel ranks, the sampler, structured outputs, the memory profile;
  configured by one ``RunnerConfig``.
- Here: the settings (``args``), the engine loop (``llm_engine``) that carries plain data from
  core to worker and back, metrics, capacity, detokenizing, and the offline (``LLM``) and async
  (``AsyncEngine``) APIs.

It may import models and kernels; never server or bench. Names are imported on first use, so
that ``engine.core`` loads without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "EngineArgs": "engine.args",
    "SamplingParams": "engine.core.sampling_params",
    "RequestOutput": "engine.core.outputs",
    "CompletionOutput": "engine.core.outputs",
    "TokenLogprob": "engine.core.outputs",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
