"""Prefix caching: the pool's cache of full blocks, and engines with caching on against off.

The oracle for the engine tests is the same engine with caching off: greedy tokens must be
identical, whatever was shared, evicted, copied on write or refused.
"""

from __future__ import annotations

import pytest

from engine import LLM
from engine.core.block_pool import BlockPool
from tests.helpers import random_prompt, run_waves, save_tiny_deepseek_v3

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 8


def make(model_dir, **kw) -> LLM:
    kw = {"num_kv_blocks": 64, "max_num_batched_tokens": 24, **kw}
    return LLM(str(model_dir), device="cpu", dtype="float32", block_size=BLOCK, **kw)


def shared_prefix_waves(vocab: int) -> list[list[tuple[list[int], int]]]:
    system = random_prompt(37, vocab, seed=1)
    first = [(system + random_prompt(5 + i, vocab, seed=10 + i), 6) for i in range(3)]
    again = [(p, 4) for p, _ in first[:2]]  # whole prompts again
    turn = [(first[0][0] + random_prompt(9, vocab, seed=20), 5)]  # a longer follow-up
    return [first + [(system, 3)], again + turn]


def test_freed_blocks_stay_findable_and_go_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]), None, (i,))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert [pool.lookup(bytes([i]), None, (i,)) for i in range(3)] == blocks
    pool.allocate(2)  # the never-used block, then the least recently freed one
    assert pool.lookup(bytes([1]), None, (1,)) is None
    assert pool.lookup(bytes([0]), None, (0,)) == blocks[0]
    pool.take(blocks[0])
    assert pool.ref_counts[blocks[0]] == 1 and pool.num_free == 1
    pool.check_integrity()


def test_a_lookup_checks_the_tokens_and_the_parent_not_only_the_key():
    pool = BlockPool(4)
    parent, child = pool.allocate(2)
    pool.register(parent, b"p", None, (5, 6))
    pool.register(child, b"c", pool.ident(parent), (7, 8))
    assert pool.lookup(b"p", None, (5, 7)) is None
    assert pool.lookup(b"c", pool.ident(parent), (7, 8)) == child
    before = pool.ident(parent)
    pool.uncache(parent)  # the parent's contents change: its children lead nowhere new
    assert pool.lookup(b"c", pool.ident(parent), (7, 8)) is None
    assert pool.lookup(b"c", before, (7, 8)) == child
    assert pool.reset_cache() == 1 and pool.lookup(b"c", before, (7, 8)) is None
    pool.check_integrity()


@pytest.fixture(scope="module")
def tiny_mla_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mla")
    save_tiny_deepseek_v3(path)
    return path


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_mla_dir"])
def test_greedy_tokens_are_the_same_with_caching_on_and_off(request, model):
    model_dir = request.getfixturevalue(model)
    waves = shared_prefix_waves(120)
    on = make(model_dir)
    tokens, cached = run_waves(on, waves)
    off_tokens, off_cached = run_waves(make(model_dir, enable_prefix_caching=False), waves)
    assert tokens == off_tokens
    assert off_cached == [0] * len(cached)
    # The second wave finds whole blocks: its repeats all but the last block of their prompt.
    assert cached[4] == cached[5] == (len(waves[1][0][0]) - 1) // BLOCK * BLOCK
    assert cached[6] >= 40
    assert all(c % BLOCK == 0 for c in cached)
    assert on.engine.kv.num_free_blocks == on.engine.kv.num_total_blocks
    hits = on.engine.metrics.prefix_hits._value.get()
    assert hits == sum(cached) > 0
    assert on.reset_prefix_cache() > 0 and on.engine.kv.num_cached_blocks == 0


def test_a_key_collision_is_refused(tiny_llama_dir, monkeypatch):
    import engine.core.kv_manager

    monkeypatch.setattr(engine.core.kv_manager, "block_hash", lambda parent, tokens: b"same")
    prompts = [[(random_prompt(30, 120, seed=s), 4)] for s in (1, 2, 1)]
    tokens, cached = run_waves(make(tiny_llama_dir), prompts)
    off_tokens, _ = run_waves(make(tiny_llama_dir, enable_prefix_caching=False), prompts)
    assert tokens == off_tokens
    # Every block claims the same key: the other prompt's block is refused; the same prompt
    # finds its first block, which holds its tokens, and no further (the key is taken).
    assert cached == [0, 0, BLOCK]


def test_a_shift_copies_shared_blocks_and_leaves_the_other_sequence_alone(
    tiny_llama_dir, monkeypatch
):
    from engine.core.kv_manager import KVCacheManager

    copies = []
    drop = KVCacheManager.drop

    def recording_drop(self, *args):
        moved, pairs = drop(self, *args)
        copies.extend(p for group in pairs for p in group)
        return moved, pairs

    monkeypatch.setattr(KVCacheManager, "drop", recording_drop)
    prompt = random_prompt(40, 120, seed=3)
    # The first fills the step budget alone; the second, admitted next, shares 4 blocks. The
    # first shifts (drops blocks 1-2) while the second runs: its block 3 is shared.
    waves = [[(prompt, 20), (prompt[:32] + random_prompt(4, 120, seed=4), 11)]]
    kw = dict(
        max_model_len=48, context_overflow="shift", context_n_keep=8, context_n_discard=16,
        max_num_batched_tokens=40,
    )  # fmt: skip
    tokens, cached = run_waves(make(tiny_llama_dir, **kw), waves)
    assert cached == [0, 32] and copies
    off_tokens, _ = run_waves(make(tiny_llama_dir, enable_prefix_caching=False, **kw), waves)
    assert tokens == off_tokens


def test_recompute_preemption_finds_its_own_blocks_again(tiny_llama_dir):
    prompts = [[(random_prompt(30, 120, seed=s), 12) for s in range(4)]]
    kw = dict(num_kv_blocks=14, preemption_mode="recompute", max_num_batched_tokens=64)
    on = make(tiny_llama_dir, **kw)
    tokens, _ = run_waves(on, prompts)
    off_tokens, _ = run_waves(make(tiny_llama_dir, enable_prefix_caching=False, **kw), prompts)
    assert tokens == off_tokens
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.metrics.prefix_hits._value.get() > 0


@pytest.mark.parametrize("window_blocks_evicted", [False, True])
def test_a_sliding_window_model_hits_where_the_last_window_is_cached(
    tmp_path, window_blocks_evicted
):
    """Gemma 3 (a ring of 5 blocks of 8 for its window of 32, and a full layer): prompts longer
    than the ring share a prefix. Evicting the local pool's cached blocks leaves the full
    layer's prefix useless: a hit needs the window before it in every group."""
    from tests.helpers import save_tiny_gemma3

    save_tiny_gemma3(tmp_path)
    system = random_prompt(70, 120, seed=1)
    first = [(system + random_prompt(9 + i, 120, seed=10 + i), 12) for i in range(2)]
    waves = [first, [(first[0][0], 5), (system + random_prompt(20, 120, seed=30), 5)]]
    on = make(tmp_path)
    if window_blocks_evicted:
        forget = on.engine.kv.pools[0].reset_cache  # the sliding-window group's pool
        step = on.engine.step
        on.engine.step = lambda: (step(), forget())[0]
    tokens, cached = run_waves(on, waves)
    assert tokens == run_waves(make(tmp_path, enable_prefix_caching=False), waves)[0]
    assert on.engine.runner.groups[0].spec.window == 32
    if window_blocks_evicted:
        assert cached == [0, 0, 0, 0]
    else:
        assert cached[2] == (len(first[0][0]) - 1) // BLOCK * BLOCK > 40
        assert cached[3] == len(system) // BLOCK * BLOCK
