"""The host tier of the prefix cache (``--kv-host-cache-gib``): prefix blocks the device pool
evicts are written down to host memory and copied back up when a request returns with them.
The oracle is the same engine without the tier: greedy tokens must be identical, and the
tokens served from the host tier must be tokens that engine computed again."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import random_prompt, save_tiny_llama

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """The tiny Llama with heads of 32 values, which every KV dtype takes."""
    path = tmp_path_factory.mktemp("tiny-llama-32")
    save_tiny_llama(path, hidden_size=128)
    return path


def engine(path, tier: bool, **kw) -> LLM:
    kw = {"num_kv_blocks": 16, "block_size": BS, **kw}
    return LLM(str(path), kv_host_cache_gib=0.01 if tier else 0.0, **kw)


def counter(llm: LLM, name: str, **labels) -> float:
    value = llm.engine.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def conversation_rounds(llm: LLM) -> list:
    """Four conversations of 5 blocks in a pool of 16 blocks, each then returning with its
    history and a new turn: by then the others have evicted it from the device pool."""
    first = [random_prompt(5 * BS + 3, 128, seed) for seed in range(4)]
    outs = [llm.generate([p], GREEDY)[0] for p in first]
    again = [p + o.outputs[0].token_ids + random_prompt(7, 128, 50 + i)
             for i, (p, o) in enumerate(zip(first, outs))]  # fmt: skip
    outs += [llm.generate([p], GREEDY)[0] for p in again]
    return outs


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "int8/int4"])
def test_returning_conversations_load_from_the_host_tier_with_the_same_tokens(
    tiny_llama_dir, kv_dtype
):
    plain = conversation_rounds(engine(tiny_llama_dir, False, kv_cache_dtype=kv_dtype))
    tier_llm = engine(tiny_llama_dir, True, kv_cache_dtype=kv_dtype)
    tiered = conversation_rounds(tier_llm)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    # Without the tier a returning conversation finds little of its history on the device;
    # with it, every full block of the first turn comes back.
    cached_plain = sum(o.num_cached_tokens for o in plain[4:])
    cached_tier = sum(o.num_cached_tokens for o in tiered[4:])
    assert cached_tier >= 4 * 5 * BS and cached_tier > cached_plain
    host_hits = counter(tier_llm, "kvserve:prefix_cache_host_hits_total")
    assert host_hits > 0
    assert counter(tier_llm, "kvserve:kv_host_tier_blocks_total", direction="stored") > 0
    loaded = counter(tier_llm, "kvserve:kv_host_tier_blocks_total", direction="loaded")
    assert loaded * BS == host_hits
    kv = tier_llm.engine.kv
    assert 0 < kv.num_cached_host_blocks <= kv.num_total_host_blocks
    tier_llm.engine.scheduler.kv.check_integrity([])


def test_a_crowded_pool_under_swap_preemption_gives_the_same_tokens(tiny_llama_dir):
    """Swap and the tier share the host pool; concurrent requests preempt one another."""
    prompts = [random_prompt(3 * BS + 5, 128, seed) for seed in range(6)]
    prompts += [p + random_prompt(9, 128, 90 + i) for i, p in enumerate(prompts[:3])]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(num_kv_blocks=12, preemption_mode="swap", swap_space_gib=0.005)
    plain = engine(tiny_llama_dir, False, **kw).generate(prompts, params)
    tiered = engine(tiny_llama_dir, True, **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("policy", ["shift", "snapkv"])
def test_overflow_policies_give_the_same_tokens(tiny_llama_dir, policy):
    """A shift re-rotates and an importance eviction compacts blocks that the tier may hold
    copies of: returning prompts still get the tokens of an engine without the tier."""
    kw = dict(max_model_len=96, context_overflow=policy)
    if policy == "snapkv":
        kw["kv_budget"] = 48
    prompts = [random_prompt(40, 128, seed) for seed in range(3)]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    runs = []
    for tier in (False, True):
        llm = engine(tiny_llama_dir, tier, num_kv_blocks=10, **kw)
        runs.append([llm.generate([p], params)[0].outputs[0].token_ids for p in prompts * 2])
    assert runs[1] == runs[0]


def test_the_tier_resets_with_the_cache_and_is_refused_without_prefix_caching(tiny_llama_dir):
    llm = engine(tiny_llama_dir, True)
    conversation_rounds(llm)
    assert llm.engine.kv.num_cached_host_blocks > 0
    llm.reset_prefix_cache()
    assert llm.engine.kv.num_cached_host_blocks == 0
    with pytest.raises(ValueError, match="needs prefix caching"):
        engine(tiny_llama_dir, True, enable_prefix_caching=False)


def test_write_through_copies_blocks_down_once_computed_with_the_same_tokens(tiny_llama_dir):
    """With a device pool large enough to evict nothing, write-through still fills the host
    tier (write-back leaves it empty); returning prompts get the same tokens either way."""
    plain = conversation_rounds(engine(tiny_llama_dir, False, num_kv_blocks=64))
    for through in (False, True):
        llm = engine(tiny_llama_dir, True, num_kv_blocks=64, kv_tier_write_through=through)
        outs = conversation_rounds(llm)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        stored = counter(llm, "kvserve:kv_host_tier_blocks_total", direction="stored")
        assert (stored >= 4 * 5) if through else stored == 0
    with pytest.raises(ValueError, match="needs --kv-host-cache-gib"):
        engine(tiny_llama_dir, False, kv_tier_write_through=True)
