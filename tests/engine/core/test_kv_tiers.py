"""The tiers under the device pools (``engine.core.kv_tiers``), pure Python: what goes down
where, in which order the runner must carry the moves out, and what the events say."""

from __future__ import annotations

import pytest

from engine.core.config import CacheConfig
from engine.core.kv_events import HOST, STORAGE, BlockStored, EventLog
from engine.core.kv_manager import KVCacheManager
from models.kv_spec import FullAttentionSpec, KVCacheGroup
from tests.engine.core.test_kv_manager import BS, compute

FULL = FullAttentionSpec(1, 4)


def tiered(device: int, host: int, disk: int) -> tuple[KVCacheManager, EventLog]:
    events = EventLog(BS)
    config = CacheConfig([KVCacheGroup(FULL, (0,))], BS, (device,), (host,), True, True, (disk,))
    return KVCacheManager(config, events), events


def fill(kv: KVCacheManager, seed: int, blocks: int):
    """A sequence of ``blocks`` full blocks computed and freed (cached): (tokens, keys)."""
    tokens = [seed * 100 + i for i in range(blocks * BS)]
    tables, keys = compute(kv, tokens)
    kv.free(tables)
    return tokens, keys


def test_blocks_go_down_one_tier_at_a_time_and_come_back_through_the_host():
    kv, events = tiered(device=4, host=2, disk=8)
    tiers = kv.tiers
    first, first_keys = fill(kv, 1, 4)
    # The second sequence evicts the first's 4 device blocks, tail first: all 4 spill to the
    # 2 host blocks, so the tail's spills are called off and written down from the device
    # (before the step refills it), and the head stays in the host tier.
    fill(kv, 2, 4)
    ops = tiers.take_disk_ops()
    assert [(op[0], op[2][0], op[3]) for op in ops] == [
        ("write", "device", first_keys[3]),
        ("write", "device", first_keys[2]),
    ]
    spills = tiers.take_spills()
    assert len(spills[0]) == 2 and not {d for d, _ in spills[0]} & {op[2][1] for op in ops}
    assert tiers.take_counts()["host"] == {"stored": 4, "loaded": 0, "dropped": 0}
    media = {e.medium for e in events.take() if isinstance(e, BlockStored)}
    assert media == {"GPU", HOST, STORAGE}
    tiers.end_step()
    fill(kv, 3, 4)  # the host's blocks of the first sequence go to disk from the host
    ops = tiers.take_disk_ops()
    assert {op[3] for op in ops if op[2][0] == "host"} == set(first_keys[:2])
    tiers.take_spills()
    tiers.end_step()

    # The first sequence returns: its blocks are all on disk; each read fills a host block,
    # whose former contents are written down before it; a step reads up as many as the host
    # pool holds (2 of the 3 asked for).
    tables = kv.new_tables()
    added, from_disk, copies = tiers.load_prefix(tables, first, first_keys, 3)
    assert (added, from_disk) == (2, 2)
    ops = tiers.take_disk_ops()
    reads = [op for op in ops if op[0] == "read"]
    assert [op[2] for op in reads] == first_keys[:2]
    for i, op in enumerate(ops):
        if op[0] == "write" and op[2][0] == "host":
            assert all(r[3] != op[2][1] for r in ops[:i] if r[0] == "read")
    assert [h for h, _ in copies[0]] == [op[3] for op in reads]  # copied up from those blocks
    kv.check_integrity([tables])


def test_a_full_disk_drops_its_least_recently_used_file():
    kv, _ = tiered(device=2, host=1, disk=1)
    for seed in range(4):
        fill(kv, seed, 2)
        kv.tiers.end_step()
    ops = kv.tiers.take_disk_ops()
    drops = [op for op in ops if op[0] == "drop"]
    writes = [op for op in ops if op[0] == "write"]
    assert drops and len(writes) == len(drops) + 1  # one file left: the bound holds
    assert all(ops.index(d) > ops.index(next(w for w in writes if w[3] == d[2])) for d in drops)
    assert kv.num_cached_disk_blocks == 1


def test_a_restart_seeds_the_disk_tier_oldest_first_within_its_bound():
    kv, _ = tiered(device=2, host=1, disk=2)
    entries = [(0, bytes([i]) * 16, (i,) * BS) for i in range(3)]
    assert kv.tiers.seed_disk(entries) == 2
    assert kv.tiers.take_disk_ops() == [("drop", 0, entries[0][1])]  # the oldest file goes
    pool = kv.tiers.disk_pools[0]
    assert pool.lookup(entries[0][1], None, entries[0][2]) is None
    assert pool.lookup(entries[2][1], None, entries[2][2]) is not None
    (first,) = pool.allocate(1)  # the next to make room: the older of the two kept
    assert pool.entry[first] is None and pool.lookup(entries[1][1], None, entries[1][2]) is None


@pytest.mark.parametrize("disk", [0, 8])
def test_a_host_block_is_the_target_of_one_spill_a_step(disk):
    """More spills in a step than host blocks: each host block is written once (copies to one
    block in one batch land in no set order), holding the block its key names."""
    events = EventLog(BS)
    disks = (disk,) if disk else ()
    config = CacheConfig([KVCacheGroup(FULL, (0,))], BS, (4,), (2,), True, True, disks)
    kv = KVCacheManager(config, events)
    _, keys = fill(kv, 1, 4)
    device_blocks = {kv.pools[0].cached[k]: k for k in keys}
    fill(kv, 2, 4)
    (spills,) = kv.tiers.take_spills()
    targets = [h for _, h in spills]
    assert len(targets) == len(set(targets)) == 2
    host = kv.host_pools[0]
    # The last two evicted (the head: a sequence's tail is evicted first) keep their spills,
    # each host block registered under the key of the device block its copy reads.
    assert [host.entry[h][0] for d, h in spills] == [device_blocks[d] for d, _ in spills]
    assert {device_blocks[d] for d, _ in spills} == set(keys[:2])
