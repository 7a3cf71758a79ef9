"""Offline batch generation without HTTP: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Callable

from engine.args import EngineArgs
from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts through the scheduler together; outputs in prompt order.
        ``on_output`` sees every step's delta of every request (for progress)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        results: dict[str, RequestOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{i}"
            self.engine.add_request(rid, ids, p)
            results[rid] = RequestOutput(rid, ids, [CompletionOutput(0)])
        while self.engine.has_unfinished:
            for delta in self.engine.step():
                _merge(results[delta.request_id], delta)
                if on_output is not None:
                    on_output(delta)
        return list(results.values())

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were cached."""
        return self.engine.reset_prefix_cache()


def _merge(total: RequestOutput, delta: RequestOutput) -> None:
    acc, new = total.outputs[0], delta.outputs[0]
    acc.text += new.text
    acc.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + new.logprobs
    acc.finish_reason, acc.stop_reason, acc.error = new.finish_reason, new.stop_reason, new.error
    total.finished = delta.finished
    total.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
