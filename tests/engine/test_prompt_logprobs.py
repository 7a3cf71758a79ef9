"""Prompt logprobs: gathered across prefill chunks, once per prompt token, whatever happens to
the request between its chunks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.context_overflow import ContextOverflow
from engine.core.errors import RequestError
from tests.helpers import random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def make(model_dir, **kw) -> LLM:
    kw = {"num_kv_blocks": 64, "max_num_batched_tokens": 24, **kw}
    return LLM(str(model_dir), device="cpu", dtype="float32", block_size=8, **kw)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list]:
    params = SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2)
    return [out.prompt_logprobs for out in llm.generate(prompts, params)]


def test_preempted_mid_prefill_each_prompt_token_is_reported_once(tiny_llama_dir, monkeypatch):
    prompts = [random_prompt(40, 120, seed=s) for s in range(4)]
    calm = prompt_logprobs(make(tiny_llama_dir, max_num_batched_tokens=512), prompts)
    tight = make(tiny_llama_dir, num_kv_blocks=16, preemption_mode="recompute",
                 max_num_batched_tokens=16)  # fmt: skip
    engine, execute = tight.engine, tight.engine.runner.execute
    repeated = []

    def recording_execute(out):
        sampled, chunks = execute(out)
        for rid, (first, _) in chunks.items():
            if len(engine._prompt_logprobs.get(rid, ())) > first:
                repeated.append(rid)  # recomputed after preemption: predicted twice
        return sampled, chunks

    monkeypatch.setattr(engine.runner, "execute", recording_execute)
    crowded = prompt_logprobs(tight, prompts)
    assert repeated
    for prompt, a, b in zip(prompts, calm, crowded):
        assert len(a) == len(b) == len(prompt) and a[0] is None and b[0] is None
        assert [r.token_id for r in b[1:]] == prompt[1:]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) < 1e-4
        assert [[t for t, _ in x.top] for x in a[1:]] == [[t for t, _ in y.top] for y in b[1:]]


def test_a_policy_that_drops_prompt_tokens_is_refused(tiny_llama_dir):
    llm = make(tiny_llama_dir, max_model_len=32)
    params = SamplingParams(
        max_tokens=4, prompt_logprobs=0, overflow=ContextOverflow("truncate", 4)
    )
    with pytest.raises(RequestError, match="prompt_logprobs needs the whole prompt"):
        llm.engine.admit(random_prompt(40, 120), params)
