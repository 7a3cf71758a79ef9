"""The tiers under the device pools: host memory, then disk. Pure Python.

Each tier is a ``BlockPool`` per KV-cache group whose cached blocks are prefix blocks, found by
the same keys and token ids as on the device (their parent is not tracked there: a lower tier's
block is found by key and verified by its tokens alone). Write-back: a registered block that a
pool hands out again is first written one tier down (device -> host -> disk), unless that tier
has it already; the least recently used block of that tier makes room, and the disk tier drops
its file. Write-through (``CacheConfig.write_through``): a device block goes down to the host
tier as soon as it is registered (computed), and is found there when the device evicts it. A
request's prefix hit continues where the device pool's ends with blocks found in the host
tier, then on disk, copied up into fresh device blocks that are registered at once (a disk
block through a host block, which keeps it).

The moves are plain data for the runner, run before everything else of the step: first the
disk operations in the order decided (``disk_ops``: a write reads a block before a later move
refills it, a read fills the host block a load copies up), then the device->host copies
(``take_spills``), then the host->device copies of the loads. The blocks they read or fill stay
held until the next step begins (``end_step``), so that nothing in the same step reuses them.
"""

from __future__ import annotations

import functools

from engine.core.block_pool import BlockPool
from engine.core.config import CacheConfig
from engine.core.kv_events import HOST, STORAGE, EventLog

BlockPairs = list[list[tuple[int, int]]]  # per group: (from block, to block)
# ("write", group, (tier, block), key, token ids): the block's contents from the host pool or,
# spilled in the same step, from the device pool; ("read", group, key, host block);
# ("drop", group, key)
DiskOp = tuple


class Tiers:
    def __init__(
        self,
        config: CacheConfig,
        pools: list[BlockPool],
        host_pools: list[BlockPool],
        events: EventLog | None,
    ):
        self.block_size = config.block_size
        self.on = config.host_tier
        self.pools, self.host_pools = pools, host_pools
        self.disk_pools = [BlockPool(n) for n in config.num_disk_blocks]
        self.spills: BlockPairs = [[] for _ in pools]
        self.pending: list[dict[int, int]] = [{} for _ in pools]  # host block -> device block
        self.disk_ops: list[DiskOp] = []
        self.pinned: list[tuple[BlockPool, list[int]]] = []
        self.moved = {
            tier: dict.fromkeys(("stored", "loaded", "dropped"), 0) for tier in ("host", "disk")
        }
        if not self.on:
            return
        for g, (pool, host) in enumerate(zip(pools, host_pools)):
            host.events, host.group, host.medium = events, g, HOST
            pool.on_evict = functools.partial(self._spill, g)
            if config.write_through:  # once computed: registered after the step's forward
                pool.on_register = functools.partial(self._spill, g)
            host.on_evict = functools.partial(self._host_evicted, g)
        for g, disk in enumerate(self.disk_pools):
            disk.events, disk.group, disk.medium = events, g, STORAGE
            disk.on_evict = functools.partial(self._drop, g)

    def pin(self, pool: BlockPool, blocks: list[int]) -> None:
        """Held until this step's copies have run."""
        self.pinned.append((pool, blocks))

    def end_step(self) -> None:
        """The previous step's copies have run: the blocks they read or filled are let go."""
        for pool, blocks in self.pinned:
            pool.free(blocks)
        self.pinned.clear()

    # -- writing down -----------------------------------------------------------------------

    def _store_below(self, tier: str, pool: BlockPool, key: bytes, tokens: tuple) -> int | None:
        """A block of the lower tier's ``pool`` registered under ``key`` and cached (the most
        recently used), its least recently used block making room; None when it has the key
        already or cannot take it (every block held)."""
        if pool.lookup(key, None, tokens) is not None:
            return None
        if not pool.num_free:
            self.moved[tier]["dropped"] += 1
            return None
        (b,) = pool.allocate(1)
        pool.register(b, key, None, tokens)
        pool.free([b])
        self.moved[tier]["stored"] += 1
        return b

    def _spill(self, group: int, block: int, entry: tuple) -> None:
        key, _, tokens = entry
        h = self._store_below("host", self.host_pools[group], key, tokens)
        if h is not None:
            self.spills[group].append((block, h))
            self.pending[group][h] = block

    def _host_evicted(self, group: int, block: int, entry: tuple) -> None:
        """A host block handed out again: its contents go to disk (where there is a disk tier),
        from wherever they are when the disk operations run."""
        source = self._source(group, block)
        if self.disk_pools:
            self._write_down(group, source, entry)

    def _write_down(self, group: int, source: tuple[str, int], entry: tuple) -> None:
        key, _, tokens = entry
        if self._store_below("disk", self.disk_pools[group], key, tokens) is not None:
            self.disk_ops.append(("write", group, source, key, tokens))

    def _source(self, group: int, host_block: int) -> tuple[str, int]:
        """Where a host block's contents are when the disk operations run: a block spilled in
        this step is still only on the device (whose block the step refills after them), and
        its spill is called off (a host block is the target of one copy a step: copies to one
        block land in no set order)."""
        device = self.pending[group].pop(host_block, None)
        if device is None:
            return ("host", host_block)
        self.spills[group].remove((device, host_block))
        return ("device", device)

    def _drop(self, group: int, block: int, entry: tuple) -> None:
        self.disk_ops.append(("drop", group, entry[0]))

    def take_spills(self) -> BlockPairs:
        """The device->host copies decided since the last call, per group."""
        spills, self.spills = self.spills, [[] for _ in self.pools]
        self.pending = [{} for _ in self.pools]
        return spills

    def take_disk_ops(self) -> list[DiskOp]:
        """The disk writes, reads and drops decided since the last call, in order."""
        ops, self.disk_ops = self.disk_ops, []
        return ops

    def seed_disk(self, entries: list[tuple[int, bytes, tuple[int, ...]]]) -> int:
        """Blocks a disk tier holds from an earlier run, (group, key, token ids) least recently
        written first, made findable: the most recent that the bound holds (the others' files are
        dropped at the next step). Returns how many."""
        kept, room = [], [pool.num_blocks for pool in self.disk_pools]
        for group, key, tokens in reversed(entries):
            if room[group]:
                kept.append((group, key, tokens))
                room[group] -= 1
            else:
                self.disk_ops.append(("drop", group, key))
        for group, key, tokens in reversed(kept):  # the oldest freed first: evicted first
            disk = self.disk_pools[group]
            (d,) = disk.allocate(1)
            disk.register(d, key, None, tokens)
            disk.free([d])
        return len(kept)

    def reset(self) -> int:
        """Forget every block of the lower tiers (the disk tier's files go too)."""
        for g, disk in enumerate(self.disk_pools):
            self.disk_ops.extend(("drop", g, key) for key in disk.cached)
        return sum(pool.reset_cache() for pool in (*self.host_pools, *self.disk_pools))

    # -- finding and copying up ---------------------------------------------------------------

    def _found(self, keys: list[bytes], token_ids: list[int], start: int, stop: int) -> list:
        """Per block from ``start``, where a lower tier holds it: (tier, its block per group,
        token ids), until one holds it in no group."""
        bs, found = self.block_size, []
        for j in range(start, stop):
            tokens = tuple(token_ids[j * bs : (j + 1) * bs])
            for tier, pools in (("host", self.host_pools), ("disk", self.disk_pools)):
                row = [pool.lookup(keys[j], None, tokens) for pool in pools]
                if pools and None not in row:
                    found.append((tier, row, tokens))
                    break
            else:
                break
        return found

    def load_prefix(
        self, tables: list[list[int]], token_ids: list[int], keys: list[bytes], max_blocks: int
    ) -> tuple[int, int, BlockPairs]:
        """Continue the prefix ``tables`` hold with the blocks after it found in the lower
        tiers (up to ``max_blocks`` in all): fresh device blocks, registered, and the
        host->device copies that fill them (disk blocks read into host blocks first). Returns
        (blocks added, of which from disk, copies per group)."""
        n = len(tables[0]) if tables else 0
        if not self.on or n >= max_blocks:
            return 0, 0, []
        found = self._found(keys, token_ids, n, max_blocks)[: min(p.num_free for p in self.pools)]
        for tier, row, _ in found:  # held first: no write-down may take them
            for pool, b in zip(self.host_pools if tier == "host" else self.disk_pools, row):
                pool.take(b)
                self.pin(pool, [b])
        sources, from_disk = [], 0
        for j, (tier, row, tokens) in enumerate(found):
            if tier == "disk":
                if not all(host.num_free for host in self.host_pools):
                    found = found[:j]
                    break
                row = [self._read_up(g, keys[n + j], tokens) for g in range(len(row))]
                from_disk += 1
            sources.append(row)
        copies: BlockPairs = []
        for g, (pool, table) in enumerate(zip(self.pools, tables)):
            fresh = pool.allocate(len(sources))
            pool.incref(fresh)
            self.pin(pool, fresh)
            for j, d, (_, _, tokens) in zip(range(n, n + len(sources)), fresh, found):
                parent = pool.ident(table[-1]) if table else None
                table.append(d)
                pool.register(d, keys[j], parent, tokens, keys[j - 1] if j else None)
            copies.append([(row[g], d) for row, d in zip(sources, fresh)])
        self.moved["host"]["loaded"] += len(sources)
        self.moved["disk"]["loaded"] += from_disk
        return len(sources), from_disk, copies

    def _read_up(self, group: int, key: bytes, tokens: tuple[int, ...]) -> int:
        """A host block, registered, that this step's disk read fills with ``key``'s block."""
        host = self.host_pools[group]
        (h,) = host.allocate(1)
        host.register(h, key, None, tokens)
        self.pin(host, [h])
        self.disk_ops.append(("read", group, key, h))
        return h

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Blocks each tier stored, loaded and dropped since the last call."""
        moved = self.moved
        self.moved = {tier: dict.fromkeys(counts, 0) for tier, counts in moved.items()}
        return moved
