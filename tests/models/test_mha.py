"""Multi-head attention (as many KV heads as query heads) through the engine, against transformers
on a random Llama checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from models.kv_spec import FullAttentionSpec
from tests.helpers import TINY_LLAMA, generate_with_logits, random_prompt, save_tiny_llama

pytest.importorskip("transformers")

TINY = {**TINY_LLAMA, "num_key_value_heads": 4}
MAX_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_mha")
    return path, save_tiny_llama(path, **TINY)


def prompt_of(length: int, seed: int) -> list[int]:
    return random_prompt(length, TINY["vocab_size"], seed, low=0)


def test_mha_logits_and_greedy_tokens_match_transformers(checkpoint, monkeypatch):
    path, model = checkpoint
    prompts = [prompt_of(n, n) for n in (1, 16, 17, 40)]
    # A budget below the longest prompt chunks its prefill alongside the others' decodes.
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype="float32",
        device="cpu",
        max_model_len=128,
        num_kv_blocks=32,
        block_size=16,
        max_num_batched_tokens=24,
    )
    (group,) = llm.engine.runner.groups
    assert group.spec == FullAttentionSpec(TINY["num_attention_heads"], 16, "float32")
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        assert k_cache.shape == v_cache.shape == (32, 16, TINY["num_attention_heads"], 16)

    results = generate_with_logits(llm, prompts, monkeypatch, MAX_TOKENS)
    for prompt, (tokens, logits) in zip(prompts, results):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        assert tokens == ref.argmax(dim=-1).tolist()
        assert (logits - ref).abs().max().item() < TOL
