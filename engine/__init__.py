"""kvserve engine: paged KV cache, continuous batching, offline and async APIs."""

from engine.config import EngineArgs
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # The model-loading parts import torch; keep `import engine` light for pure-Python users.
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
