"""The engine: settings (``args``), scheduler, KV-cache manager and block pools, overflow
policies (``context_overflow``, ``preemption``), model runner, sampler, metrics, and the offline
(``LLM``) and async (``AsyncEngine``) APIs.

It may import models and kernels; never server or bench.
"""

from engine.args import EngineArgs
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # The model-loading parts (weights, tokenizer) are imported on first use.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TokenLogprob",
]
