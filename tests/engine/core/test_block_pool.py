"""Block pool invariants, and the specs' bytes per token (pure Python); the KV manager's are in
test_kv_manager.py."""

import pytest

from engine.core.block_pool import BlockPool
from models.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec


def test_pool_allocates_distinct_blocks_and_takes_them_back():
    pool = BlockPool(8)
    a, b = pool.allocate(3), pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free == 0
    pool.check_integrity()
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    pool.check_integrity()
    assert pool.num_free == 3
    pool.free(b)
    assert pool.num_free == 8 and pool.usage == 0.0


def test_pool_ref_counts_shared_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_free == 2  # still held once
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(blocks)
    pool.check_integrity()


def test_integrity_check_catches_a_corrupt_pool():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_counts[3] = 1  # held but still listed free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_bytes_per_token_per_layout():
    assert FullAttentionSpec(3, 64, "float32").bytes_per_token == 2 * 3 * 64 * 4
    assert MLASpec(512, 64, "bfloat16").bytes_per_token == 576 * 2
    group = KVCacheGroup(FullAttentionSpec(3, 64, "bfloat16"), tuple(range(30)))
    assert group.bytes_per_token == 30 * 2 * 3 * 64 * 2
