"""Multi-head attention (as many KV heads as query heads) through the engine, against transformers
on a random Llama checkpoint."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_spec import FullAttentionSpec

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    # Larger than the default 0.02 so attention is far from uniform.
    initializer_range=0.2,
)
MAX_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_mha")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model = model.to(torch.float32).eval()
    model.save_pretrained(path)
    return path, model


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (length,), generator=g).tolist()


def generate_with_logits(llm: LLM, prompts: list[list[int]], monkeypatch):
    """Greedy generation; returns per prompt (token ids, the logits each token was sampled from)."""
    seen = defaultdict(list)
    sample = llm.engine.runner.sampler.sample

    def recording_sample(logits, request_ids, *args):
        for rid, row in zip(request_ids, logits):
            seen[rid].append(row.detach().float().clone())
        return sample(logits, request_ids, *args)

    monkeypatch.setattr(llm.engine.runner.sampler, "sample", recording_sample)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, torch.stack(seen[o.request_id])) for o in outs]


def test_mha_logits_and_greedy_tokens_match_transformers(checkpoint, monkeypatch):
    path, model = checkpoint
    prompts = [prompt_of(n, n) for n in (1, 16, 17, 40)]
    # A budget below the longest prompt chunks its prefill alongside the others' decodes.
    llm = LLM(
        str(path),
        dtype="float32",
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

    for prompt, (tokens, logits) in zip(prompts, generate_with_logits(llm, prompts, monkeypatch)):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        assert tokens == ref.argmax(dim=-1).tolist()
        assert (logits - ref).abs().max().item() < TOL
