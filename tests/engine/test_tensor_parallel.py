"""Tensor parallelism on CPU over gloo: N ranks (processes) give the tokens one rank gives."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError
from models.tokenizer import Tokenizer
from tests.helpers import random_prompt, save_tiny_deepseek_v3, save_tiny_gemma3

pytestmark = pytest.mark.slow


def greedy(model_dir, prompts: list[list[int]], tp: int, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, num_kv_blocks=64,
              block_size=8, max_num_batched_tokens=24, **kw)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()


def test_two_ranks_give_the_tokens_of_one_gqa_and_sliding_window(tiny_llama_dir, tmp_path):
    """Llama (4 query heads, 2 KV heads) and Gemma 3 (interleaved sliding window), chunked
    prefills beside decodes."""
    prompts = [random_prompt(n, 120, seed=n) for n in (5, 30, 47)]
    assert greedy(tiny_llama_dir, prompts, 2) == greedy(tiny_llama_dir, prompts, 1)
    save_tiny_gemma3(tmp_path)
    long = [random_prompt(n, 250, seed=n) for n in (9, 70)]  # past the 32-token window
    assert greedy(tmp_path, long, 2) == greedy(tmp_path, long, 1)


def test_heads_that_do_not_divide_are_refused_with_the_sizes_that_work(smollm2_dir):
    with pytest.raises(ValueError, match="9 attention heads and 3 KV heads do not divide over 2"):
        LLM(str(smollm2_dir), device="cpu", tensor_parallel_size=2)


def test_smollm2_over_three_ranks_equals_one(smollm2_dir):
    ids = Tokenizer.from_dir(smollm2_dir).encode("The capital of France is")
    one = greedy(smollm2_dir, [ids], 1, max_model_len=256)
    assert greedy(smollm2_dir, [ids], 3, max_model_len=256) == one


def test_a_rank_that_dies_ends_the_engine_with_an_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, num_kv_blocks=32,
              block_size=8)  # fmt: skip
    try:
        llm.generate([random_prompt(5, 120)], SamplingParams(max_tokens=2))
        worker = llm.engine.workers.procs[0]
        worker.kill()
        worker.join()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[1\] exited"):
            llm.generate([random_prompt(5, 120)], SamplingParams(max_tokens=2))
    finally:
        llm.engine.shutdown()


def test_two_ranks_give_the_tokens_of_one_mla_with_experts(tmp_path):
    """DeepSeek-V3 (MLA heads split, latent replicated; a dense layer, then a mixture of
    experts split per expert), chunked prefills beside decodes."""
    save_tiny_deepseek_v3(tmp_path)
    prompts = [random_prompt(n, 128, seed=n) for n in (5, 30, 47)]
    assert greedy(tmp_path, prompts, 2) == greedy(tmp_path, prompts, 1)
