"""The prefix cache's events (``engine.core.kv_events``), as the pools record them: pure Python."""

from engine.core.block_pool import block_hash
from engine.core.config import CacheConfig
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    external_hash,
)
from engine.core.kv_manager import KVCacheManager
from models.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

BS = 4


def run(kv: KVCacheManager, tokens: list[int], chunk: int = 8, steps=None):
    """``tokens`` computed a chunk at a time, as the scheduler does: (tables, keys). Each
    chunk's events go to ``steps`` (a list) where given, as the engine takes them per step."""
    tables, keys, registered = kv.new_tables(), [], 0
    for end in range(chunk, len(tokens) + chunk, chunk):
        end = min(end, len(tokens))
        kv.allocate(tables, end, end - chunk)
        registered = kv.cache_blocks(tables, tokens, keys, end, registered)
        if steps is not None:
            steps.append(kv.pools[0].events.take())
    return tables, keys


def test_a_sequence_is_announced_down_its_chain_then_evicted_and_cleared():
    log = EventLog(BS)
    kv = KVCacheManager(CacheConfig([KVCacheGroup(FullAttentionSpec(1, 4), (0,))], BS, (6,),
                                    (), True), log)  # fmt: skip
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    steps = []
    tables, keys = run(kv, tokens, steps=steps)
    # Chunks of 8 register blocks 0-1, then block 2: a step each, the second after the first.
    assert steps == [
        [BlockStored([external_hash(keys[0]), external_hash(keys[1])], None, tokens[:8], BS)],
        [BlockStored([external_hash(keys[2])], external_hash(keys[1]), tokens[8:12], BS)],
    ]
    assert keys[1] == block_hash(keys[0], tuple(tokens[4:8]))  # the chain the hashes carry
    assert external_hash(keys[2]) == int.from_bytes(keys[2][8:], "big")
    kv.free(tables)
    other, _ = run(kv, list(range(500, 520)))  # 5 blocks: two of the cached ones are reused
    removed = [h for e in log.take() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # The sequence's tail was freed first, so it goes first.
    assert removed == [external_hash(keys[2]), external_hash(keys[1])]
    kv.free(other)
    assert kv.reset_prefix_cache() > 0 and log.take() == [AllBlocksCleared()]


def test_groups_are_named_and_a_ring_announces_what_it_keeps():
    log = EventLog(BS)
    groups = [KVCacheGroup(SlidingWindowSpec(1, 4, window_size=6), (0,)),
              KVCacheGroup(FullAttentionSpec(1, 4), (1,))]  # fmt: skip
    kv = KVCacheManager(CacheConfig(groups, BS, (8, 8), (), True), log)
    run(kv, list(range(16)), chunk=16)
    stored = [e for e in log.take() if isinstance(e, BlockStored)]
    assert [e.group_idx for e in stored] == [0, 1]
    ring, full = stored
    assert len(full.block_hashes) == 4 and full.parent_block_hash is None
    # The ring still holds the last 3 blocks, of which every hash chains from the one before.
    assert ring.block_hashes == full.block_hashes[1:]
    assert ring.parent_block_hash == full.block_hashes[0] and ring.token_ids == list(range(4, 16))


def test_no_log_no_events():
    kv = KVCacheManager(CacheConfig([KVCacheGroup(FullAttentionSpec(1, 4), (0,))], BS, (4,),
                                    (), True))  # fmt: skip
    run(kv, list(range(8)))
    assert all(p.events is None for p in kv.pools)


def test_one_step_sends_one_event_per_chain():
    log = EventLog(16)
    a, b, c, x = (bytes([i]) * 16 for i in range(4))
    log.stored(a, None, [1] * 16, 0)
    log.stored(b, a, [2] * 16, 0)  # down the chain: the same event
    log.stored(c, x, [3] * 16, 0)  # another chain
    log.removed(a, 0)
    log.removed(b, 0)
    log.cleared()
    log.cleared()
    h = external_hash
    assert log.take() == [
        BlockStored([h(a), h(b)], None, [1] * 16 + [2] * 16, 16),
        BlockStored([h(c)], h(x), [3] * 16, 16),
        BlockRemoved([h(a), h(b)]),
        AllBlocksCleared(),
    ]
