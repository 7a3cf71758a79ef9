"""The start-up memory profile: the dummy step is the largest the scheduler can make, and the KV
cache gets what the device's share leaves after weights, activations and non-torch memory."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.config import GIB
from engine.worker.memory import MemoryProfile, dummy_lengths
from engine.worker.model_runner import ModelRunner
from models.tensor_parallel import NO_TP
from tests.helpers import save_tiny_deepseek_v3, save_tiny_gemma3, save_tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles GPU memory")


@pytest.mark.parametrize("tokens", [1, 5, 64, 100, 2048, 5000])
@pytest.mark.parametrize("seqs", [1, 8, 256])
@pytest.mark.parametrize("max_len", [16, 1000, 4096])
def test_dummy_lengths_fill_the_step_within_the_context(tokens, seqs, max_len):
    lengths = dummy_lengths(tokens, seqs, max_len)
    assert sum(lengths) == tokens
    assert all(1 <= n <= max_len for n in lengths)
    assert max(lengths) - min(lengths) <= 1
    # Enough sequences for the context, and logits for as many as the step can sample.
    assert len(lengths) == max(math.ceil(tokens / max_len), min(seqs, tokens))


def test_kv_cache_gets_the_share_left_after_the_rest():
    p = MemoryProfile(80 * GIB, 16 * GIB, 3 * GIB, GIB // 2, 0.9)
    assert p.kv_cache == int(72 * GIB) - 16 * GIB - 3 * GIB - GIB // 2
    assert p.check(2048) == p.kv_cache
    assert "KV cache 52.50" in p.describe() and "of 80.00 at 90%" in p.describe()
    full = MemoryProfile(24 * GIB, 16 * GIB, 6 * GIB, GIB, 0.9)
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--max-num-batched-tokens"):
        full.check(8192)


def test_gpu_memory_utilization_is_a_share():
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(model="m", gpu_memory_utilization=bad)


@pytest.mark.parametrize("save", [save_tiny_llama, save_tiny_gemma3, save_tiny_deepseek_v3])
def test_profile_run_steps_every_layout_at_the_largest_size(tmp_path, monkeypatch, save):
    save(tmp_path)
    runner = ModelRunner(EngineArgs(model=str(tmp_path), device="cpu").runner_config(), NO_TP)
    steps = []
    execute = runner.execute

    def spy(out, sample=True):
        sampled, prompt_logprobs = execute(out, sample)
        steps.append((out, runner.cache_config, sampled, prompt_logprobs))
        return sampled, prompt_logprobs

    monkeypatch.setattr(runner, "execute", spy)
    # 200 tokens in a context of 64: four prompts of 50; Gemma's local ring (3 blocks) wraps.
    assert runner.profile_run(200, 2, 64, 16) == 0  # nothing measures a CPU's peak
    (out, config, sampled, prompt_logprobs) = steps[0]
    assert [len(s.token_ids) for s in out.scheduled] == [50] * 4
    assert out.num_decodes == 0 and all(s.sample for s in out.scheduled)
    for gi, group in enumerate(config.groups):
        tables = [s.block_tables[gi] for s in out.scheduled]
        used = [b for t in tables for b in t]
        assert len(used) == len(set(used)) == config.num_blocks[gi]
        for s, t in zip(out.scheduled, tables):
            assert len(t) == group.spec.num_blocks(len(s.token_ids), 16)
    # Every prompt sampled; the first also with logprobs and its prompt's logprobs.
    assert all(not isinstance(r, Exception) for r in sampled.values()) and len(sampled) == 4
    assert sampled["profile-0"][0][1] is not None
    assert len(prompt_logprobs["profile-0"][1]) == 49
    assert runner.kv_caches == [] and runner.cache_config is None  # the pool is freed


def serve_four_long_prompts(llm: LLM) -> None:
    """Four prompts of 1,000 tokens through the engine's offline API, to their end."""
    outs = llm.generate(
        [[5] * 1000 for _ in range(4)], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 4


def test_the_long_prompts_of_the_gpu_profile_test_serve_on_the_cpu(tmp_path):
    """The GPU test below runs where no CI does: its calls into the engine run here too."""
    save_tiny_llama(tmp_path, max_position_embeddings=2048)
    serve_four_long_prompts(LLM(str(tmp_path), device="cpu", max_num_batched_tokens=4096))


@cuda
def test_engine_sized_by_the_profile_fits_its_share(tmp_path):
    save_tiny_llama(tmp_path, max_position_embeddings=2048)
    free, total = torch.cuda.mem_get_info()
    llm = LLM(str(tmp_path), device="cuda", gpu_memory_utilization=0.5, max_num_batched_tokens=4096)
    torch.cuda.reset_peak_memory_stats()
    serve_four_long_prompts(llm)
    used = total - torch.cuda.mem_get_info()[0] - (total - free)
    assert torch.cuda.max_memory_allocated() <= 0.5 * total
    assert used <= 0.5 * total
    # And the cache took the share's rest: the tiny model's weights and activations are small.
    kv = sum(t.numel() * t.element_size() for k, _ in llm.engine.runner.kv_caches for t in [k] * 2)
    assert kv >= 0.5 * total - (total - free) - GIB
