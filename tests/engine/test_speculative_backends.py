"""Speculative decoding through every attention backend: the verification step is a chunk of
several tokens over a cached prefix, which each backend must attend to as a decode of one
token at a time would (the Triton kernels under the interpreter here)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kernels import cpu
from tests.helpers import random_prompt


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_speculative_tokens_equal_plain_decoding_on_each_backend(tiny_llama_dir, backend):
    if backend == "cpu" and cpu.load() is not None:
        pytest.skip(f"the C++ kernels are unavailable: {cpu.load()}")
    prompts = [random_prompt(n, 128, seed=n) for n in (9, 23)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # float32 on every device: in bfloat16 (CUDA's default) a verify chunk and one-token steps
    # round differently, and a random model's near ties then pick other tokens.
    common = dict(num_kv_blocks=32, block_size=16, attention_backend=backend, dtype="float32")
    plain = LLM(str(tiny_llama_dir), **common)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for spec in ({"speculative_method": "ngram"}, {"speculative_model": str(tiny_llama_dir)}):
        llm = LLM(str(tiny_llama_dir), num_speculative_tokens=3, **common, **spec)
        assert llm.engine.runner.backend.name == backend
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, spec
        method = llm.engine.speculation.method
        assert llm.engine.metrics.spec_draft_tokens.labels(method)._value.get() > 0
