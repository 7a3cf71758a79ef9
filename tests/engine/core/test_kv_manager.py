"""The KV manager and its table managers, one per cache spec (pure Python): growth, ring reuse,
prefix hits, drops, and every block accounted for (``check_integrity``) after each."""

import pytest

from engine.core.config import CacheConfig
from engine.core.kv_manager import KVCacheManager
from engine.core.kv_tables import FullAttentionManager, SlidingWindowManager
from models.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec, SlidingWindowSpec

BS = 4
FULL = FullAttentionSpec(1, 4)
MLA = MLASpec(8, 4)
RING = SlidingWindowSpec(1, 4, window_size=6)  # a ring of 3 blocks of 4
WIDE_RING = SlidingWindowSpec(1, 4, window_size=30)  # a ring of 9: never wraps below 33 tokens


def manager(specs, num_blocks, prefix_caching=False, bs=BS) -> KVCacheManager:
    groups = [KVCacheGroup(spec, (i,)) for i, spec in enumerate(specs)]
    return KVCacheManager(CacheConfig(groups, bs, tuple(num_blocks), (), prefix_caching))


def compute(kv: KVCacheManager, tokens: list[int], tables=None, start: int = 0, chunk: int = BS):
    """Computes ``tokens`` from ``start`` a chunk at a time as the scheduler does (growing the
    tables, then registering the blocks full of computed tokens): (tables, block keys)."""
    tables = tables if tables is not None else kv.new_tables()
    keys, registered = [], start // BS
    for end in range(start + chunk, len(tokens) + chunk, chunk):
        end = min(end, len(tokens))
        kv.allocate(tables, end, end - chunk)
        registered = kv.cache_blocks(tables, tokens, keys, end, registered)
    return tables, keys


def assert_all_free(kv: KVCacheManager) -> None:
    kv.check_integrity([])
    assert kv.num_free_blocks == kv.num_total_blocks


def test_each_spec_gets_its_table_manager():
    kv = manager([RING, FULL, MLA], (4, 4, 4))
    kinds = [type(m) for m in kv.managers]
    assert kinds == [SlidingWindowManager, FullAttentionManager, FullAttentionManager]


def test_manager_is_all_or_nothing_and_ring_bounded():
    groups = [
        KVCacheGroup(SlidingWindowSpec(1, 8, window_size=32), (0, 1)),
        KVCacheGroup(FullAttentionSpec(1, 8), (2,)),
    ]
    kv = KVCacheManager(CacheConfig(groups, 16, (10, 10)))
    tables = kv.new_tables()
    with pytest.raises(MemoryError):
        kv.allocate(tables, 200)
    assert tables == [[], []] and kv.num_free_blocks == 20
    kv.allocate(tables, 150)
    assert [len(t) for t in tables] == [3, 10]
    kv.check_integrity([tables])
    kv.free(tables)
    assert kv.num_free_blocks == 20
    kv.check_integrity([])


# ---- ring reuse ----


def test_a_ring_reuses_its_entries_as_positions_leave_the_window():
    kv = manager([RING, FULL], (10, 20))
    tables = kv.new_tables()
    kv.allocate(tables, 12)
    ring = list(tables[0])
    for n in range(13, 41):
        assert kv.blocks_needed(tables, n, n - 1) == [0, int(n % BS == 1)]
        assert kv.allocate(tables, n, n - 1) == [[], []]
        assert tables[0] == ring  # position p in entry (p // 4) % 3, the same three blocks
    assert len(tables[1]) == 10 and kv.num_free_blocks == 7 + 10
    kv.check_integrity([tables])
    kv.free(tables)
    assert_all_free(kv)


def test_a_ring_entry_holding_a_cached_block_gets_a_fresh_one_before_it_is_overwritten():
    kv = manager([RING], (10,), prefix_caching=True)
    tokens = list(range(50, 70))
    tables, keys = compute(kv, tokens[:12])
    first = tables[0][0]  # positions 0-3, registered
    # Position 12 goes to entry 0; its window [7, 12] does not read positions 0-3: no copy.
    assert kv.blocks_needed(tables, 13, 12) == [1]
    assert kv.allocate(tables, 13, 12) == [[]]
    assert tables[0][0] != first and first not in tables[0]
    assert kv.pools[0].lookup(keys[0], None, tuple(tokens[:4])) == first  # still findable
    kv.check_integrity([tables])
    kv.free(tables)
    assert_all_free(kv)


def test_a_prefill_chunk_that_still_reads_an_entry_it_overwrites_copies_it_first():
    kv = manager([RING], (10,), prefix_caching=True)
    tables, _ = compute(kv, list(range(50, 58)))
    first = tables[0][0]
    # Positions 8-15 in one chunk: 12-15 overwrite entry 0, which position 8's window
    # [3, 8] still reads (position 3): the old block is copied into the fresh one first.
    assert kv.blocks_needed(tables, 16, 8) == [2]
    assert kv.allocate(tables, 16, 8) == [[(first, tables[0][0])]]
    kv.check_integrity([tables])
    kv.free(tables)
    assert_all_free(kv)


# ---- prefix hits, per spec ----


@pytest.mark.parametrize("spec", [FULL, MLA], ids=["full", "mla"])
def test_a_full_group_hits_the_chain_of_cached_blocks_up_to_its_first_miss(spec):
    kv = manager([spec], (16,), prefix_caching=True)
    tokens = list(range(50, 70))  # five blocks
    tables, keys = compute(kv, tokens)
    held = list(tables[0])
    kv.free(tables)
    n, found = kv.find_prefix(tokens, keys, len(tokens) - 1)
    assert n == 4 and found == [held[:4]]  # the last token is left to compute
    assert kv.find_prefix(tokens, keys, 9)[0] == 2  # whole blocks of max_tokens only
    kv.pools[0].uncache(held[2])  # its contents change: a hole in the chain
    n, found = kv.find_prefix(tokens, keys, len(tokens) - 1)
    assert n == 2 and found == [held[:2]]  # the cached blocks after the hole do not count
    other = tokens[:4] + [1, 2, 3, 4] + tokens[8:]
    assert kv.find_prefix(other, kv.block_keys(other, []), 19)[0] == 1
    tables = kv.new_tables()
    assert kv.take_prefix(tables, (n, found)) == 8 and tables == [held[:2]]
    kv.check_integrity([tables])
    kv.free(tables)
    assert_all_free(kv)


def test_a_ring_hits_where_the_next_tokens_window_is_cached():
    kv = manager([RING], (10,), prefix_caching=True)
    tokens = list(range(50, 71))  # five whole blocks and one token
    tables, keys = compute(kv, tokens)
    kv.free(tables)
    n, found = kv.find_prefix(tokens, keys, 20)
    assert n == 5 and None not in found[0]  # each block was registered while the ring held it
    blocks = found[0]
    kv.pools[0].uncache(blocks[1])  # outside the window of 20 ([15, 20]): still a hit
    assert kv.find_prefix(tokens, keys, 20)[0] == 5
    kv.pools[0].uncache(blocks[4])  # inside it: the hit ends where the window is cached
    n, found = kv.find_prefix(tokens, keys, 20)
    assert n == 4 and found[0][1] is None  # the window of 16, [11, 16], is blocks 2 and 3
    tables = kv.new_tables()
    assert kv.take_prefix(tables, (n, found)) == 16
    ring = tables[0]  # blocks 2 and 3 in entries 2 and 0; entry 1 fresh, never read
    assert (ring[2], ring[0]) == (blocks[2], blocks[3]) and ring[1] not in blocks
    kv.check_integrity([tables])
    kv.free(tables)
    assert_all_free(kv)


def test_a_hybrid_hit_is_the_longest_every_group_serves():
    kv = manager([RING, FULL], (10, 16), prefix_caching=True)
    tokens = list(range(50, 71))
    tables, keys = compute(kv, tokens)
    kv.free(tables)
    n, found = kv.find_prefix(tokens, keys, 20)
    assert n == 5
    ring, full = found
    kv.pools[1].uncache(full[3])  # the full group serves 3 blocks
    kv.pools[0].uncache(ring[1])  # the ring serves 5, but not 3 or 2: their windows need it
    n, found = kv.find_prefix(tokens, keys, 20)
    assert n == 1
    tables = kv.new_tables()
    assert kv.take_prefix(tables, (n, found)) == 4 and tables == [[ring[0]], [full[0]]]
    kv.free(tables)
    assert_all_free(kv)


def test_a_hit_whose_fresh_ring_blocks_do_not_fit_takes_nothing():
    kv = manager([FULL, RING], (16, 6), prefix_caching=True)
    tokens = list(range(50, 70))
    tables, keys = compute(kv, tokens)
    kv.free(tables)
    hit = kv.find_prefix(tokens, keys, 19)
    holder = kv.new_tables()
    assert kv.take_prefix(holder, hit) == 16  # holds the window blocks and one fresh block
    rest = kv.pools[1].allocate(kv.pools[1].num_free)  # no fresh ring block is left
    before = [list(p.ref_counts) for p in kv.pools]
    tables = kv.new_tables()
    assert kv.take_prefix(tables, hit) == 0
    assert tables == [[], []] and [p.ref_counts for p in kv.pools] == before
    kv.pools[1].free(rest)
    kv.check_integrity([holder])
    kv.free(holder)
    assert_all_free(kv)


# ---- drops ----


def test_drop_removes_whole_blocks_from_a_full_table():
    kv = manager([FULL], (10,))
    tables = kv.new_tables()
    kv.allocate(tables, 20)
    a, b, c, d, e = tables[0]
    assert kv.max_discard(tables, 19, 4) == 12  # whole blocks of cached tokens only
    moved, _ = kv.drop(tables, 19, 4, 8)
    assert tables == [[a, d, e]] and moved == [[d, e]]
    assert kv.num_free_blocks == 7
    kv.check_integrity([tables])
    with pytest.raises(ValueError):
        kv.drop(tables, 11, 2, 4)  # not block aligned


def test_drop_turns_a_full_ring_and_keeps_its_blocks():
    kv = manager([RING], (10,))
    tables = kv.new_tables()
    kv.allocate(tables, 24)
    a, b, c = tables[0]
    # The next window, [n - 5, n], must start after the kept tokens: 23 - 4 - 5 = 14 -> 12.
    assert kv.max_discard(tables, 23, 4) == 12
    moved, _ = kv.drop(tables, 23, 4, 8)
    assert tables == [[c, a, b]] and moved == [[c, a, b]]
    assert kv.num_free_blocks == 7


def test_drop_treats_a_ring_that_never_wrapped_like_a_full_table():
    kv = manager([WIDE_RING], (10,))
    tables = kv.new_tables()
    kv.allocate(tables, 20)
    a, b, c, d, e = tables[0]
    assert kv.max_discard(tables, 19, 4) == 12
    kv.drop(tables, 19, 4, 8)
    assert tables == [[a, d, e]]


@pytest.mark.parametrize(
    "specs", [[FULL], [MLA], [RING], [WIDE_RING], [RING, FULL]],
    ids=["full", "mla", "ring", "wide-ring", "ring+full"],
)  # fmt: skip
def test_a_drop_copies_shared_blocks_and_free_returns_every_block(specs):
    kv = manager(specs, (16,) * len(specs), prefix_caching=True)
    tokens = list(range(50, 74))
    a, _ = compute(kv, tokens)
    b_tokens = tokens[:16] + [1, 2, 3, 4]
    b = kv.new_tables()
    assert kv.take_prefix(b, kv.find_prefix(b_tokens, kv.block_keys(b_tokens, []), 19)) == 16
    b_held = [list(t) for t in b]
    block_3 = [t[3 % len(t)] for t in a]  # shared with b, and moved by the drop
    moved, copies = kv.drop(a, 24, 4, 8)  # blocks 1-2 go (a wrapped ring turns instead)
    assert b == b_held  # the other sequence keeps its blocks
    for table, other, blocks, pairs, shared in zip(a, b, moved, copies, block_3):
        assert [old for old, _ in pairs] == [shared]  # copied on write
        assert all(new in table for _, new in pairs)
        assert set(blocks) <= set(table) and set(blocks).isdisjoint(other)
    kv.check_integrity([a, b])
    kv.free(a)
    kv.check_integrity([b])
    kv.free(b)
    assert_all_free(kv)


def test_a_drop_without_free_blocks_for_its_copies_changes_nothing():
    kv = manager([FULL], (8,), prefix_caching=True)
    tokens = list(range(50, 74))
    a, _ = compute(kv, tokens)  # six blocks
    b = kv.new_tables()
    kv.take_prefix(b, kv.find_prefix(tokens, kv.block_keys(tokens, []), 23))  # shares five
    rest = kv.pools[0].allocate(kv.pools[0].num_free)
    held = [list(t) for t in a]
    with pytest.raises(MemoryError):
        kv.drop(a, 24, 4, 4)  # blocks 2-4, shared, need copies; block 1 frees none
    assert a == held
    kv.pools[0].free(rest)
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_the_admission_discard_end_is_that_of_a_sequence_filling_the_context():
    limit = 32
    for specs in ([FULL], [MLA], [RING], [WIDE_RING], [RING, FULL]):
        kv = manager(specs, (16,) * len(specs))
        tables = kv.new_tables()
        kv.allocate(tables, limit - 1)
        assert kv.discard_end_when_full(limit) == kv.discard_end(tables, limit - 1)
    assert manager([FULL], (16,)).discard_end_when_full(limit) == 28
    assert manager([RING, FULL], (16, 16)).discard_end_when_full(limit) == 31 - 5


# ---- integrity ----


def test_check_integrity_catches_a_leak_a_double_count_and_an_overlong_ring():
    kv = manager([FULL, RING], (8, 8))
    tables = kv.new_tables()
    kv.allocate(tables, 20)
    kv.check_integrity([tables])
    with pytest.raises(AssertionError, match="refs"):
        kv.check_integrity([])  # held by no live sequence: a leak
    with pytest.raises(AssertionError, match="refs"):
        kv.check_integrity([tables, tables])  # claimed twice, held once
    ring = kv.managers[1]
    overlong = ring.pool.allocate(4)  # one more than the ring's 3 entries
    with pytest.raises(AssertionError, match="a table of 4 blocks"):
        ring.check_integrity([tables[1], overlong])
    ring.pool.free(overlong)
    kv.free(tables)
    assert_all_free(kv)
