"""Per-sequence block tables over one block pool per KV-cache group. Pure Python.

A model's layers fall into groups of one cache format each (Gemma 3: a sliding-window group and
a full one); a sequence holds one block table per group. ``KVCacheManager`` composes one table
manager per group (``kv_tables``: one class per format) and keeps what spans the groups: a
sequence grows in every group or in none, its prefix hit is the longest that every group can
serve, and its block keys (one per full block of tokens) are shared by the groups.

Besides growing and freeing tables, the manager carries out two cache moves and describes the
copies or rotations they need; the model runner performs them before the step's forward pass:

- ``drop``: a context shift removes whole blocks of tokens after the kept ones; the blocks
  after them hold keys that must move down (be re-rotated). A sliding-window ring may turn
  instead (``kv_tables``).
- ``swap_out`` / ``swap_in``: a preempted sequence's blocks go to a host pool and come back
  into fresh device blocks, in table order (which a ring's addressing depends on).

Prefix caching (``BlockPool`` keeps the cache): a sequence's full blocks of computed tokens are
registered under chained keys of its token ids (``cache_blocks``), and a new sequence starts
with a cached prefix of whole blocks (``find_prefix``), shared with reference counts. For
Gemma 3 the hit is the longest run of cached blocks whose last window is still cached in the
local layers' pool too. A shift copies a shared block before its keys are rotated
(copy-on-write), and a block that is rotated in place leaves the cache.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.core.block_pool import BlockPool, block_hash
from engine.core.config import CacheConfig
from engine.core.kv_events import EventLog
from engine.core.kv_tables import BlockPair, TableManager, check_owners, table_manager
from engine.core.kv_tiers import Tiers

BlockTables = list[list[int]]  # one table per group
BlockPairs = list[list[BlockPair]]  # per group: (from block, to block)
PrefixHit = tuple[int, list[list[int | None]]]  # (blocks, per group the cached blocks found)


class KVCacheManager:
    def __init__(self, config: CacheConfig, events: EventLog | None = None):
        """``events``: where the device pools record their prefix-cache events (KV events)."""
        self.config = config
        self.groups = config.groups
        self.managers: list[TableManager] = [
            table_manager(g.spec, config.block_size, n, config.prefix_caching)
            for g, n in zip(config.groups, config.num_blocks)
        ]
        self.pools = [m.pool for m in self.managers]
        for g, pool in enumerate(self.pools):
            pool.events, pool.group = events, g
        self.host_pools = [BlockPool(n) for n in config.num_host_blocks]
        self.host_tier = config.host_tier
        self.tiers = Tiers(config, self.pools, self.host_pools, events)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_tables(self) -> BlockTables:
        return [[] for _ in self.groups]

    def _each(self, tables: BlockTables) -> Iterator[tuple[TableManager, list[int]]]:
        return zip(self.managers, tables)

    def blocks_needed(self, tables: BlockTables, num_tokens: int, start: int = 0) -> list[int]:
        """Blocks each group must add for the sequence to hold ``num_tokens`` tokens, writing
        those from ``start`` on."""
        return [m.blocks_needed(t, num_tokens, start) for m, t in self._each(tables)]

    def can_allocate(self, tables: BlockTables, num_tokens: int, start: int = 0) -> bool:
        needed = self.blocks_needed(tables, num_tokens, start)
        return all(n <= pool.num_free for n, pool in zip(needed, self.pools))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the pools when they are empty."""
        return all(m.can_ever_fit(num_tokens) for m in self.managers)

    def allocate(self, tables: BlockTables, num_tokens: int, start: int = 0) -> BlockPairs:
        """Grow ``tables`` in place to hold ``num_tokens``; all groups or none. Returns per
        group the copies to make first (old block, fresh block): ring entries that tokens from
        ``start`` on write over get fresh blocks while others may still read the old ones, and
        the step's own tokens may too."""
        if not self.can_allocate(tables, num_tokens, start):
            raise MemoryError("not enough free KV blocks")
        return [m.allocate(t, num_tokens, start) for m, t in self._each(tables)]

    def free(self, tables: BlockTables) -> None:
        for m, table in self._each(tables):
            m.free(table)

    def trim(self, tables: BlockTables, num_tokens: int) -> None:
        """Shrink ``tables`` to the blocks ``num_tokens`` tokens need."""
        for m, table in self._each(tables):
            m.trim(table, num_tokens)

    # -- prefix caching -----------------------------------------------------------------------

    @property
    def prefix_caching(self) -> bool:
        return self.config.prefix_caching

    def block_keys(self, token_ids: list[int], keys: list[bytes]) -> list[bytes]:
        """Extend ``keys`` (a sequence's, kept between calls) to every full block of
        ``token_ids``."""
        bs = self.block_size
        for j in range(len(keys), len(token_ids) // bs):
            block = tuple(token_ids[j * bs : (j + 1) * bs])
            keys.append(block_hash(keys[-1] if keys else None, block))
        return keys

    def find_prefix(self, token_ids: list[int], keys: list[bytes], max_tokens: int) -> PrefixHit:
        """The longest prefix of whole blocks of ``token_ids`` (at most ``max_tokens`` tokens)
        that every group can serve from the cache: (its blocks, per group the cached block of
        each of its blocks, None where a sliding-window group has none)."""
        n = min(max_tokens // self.block_size, len(keys))
        found = []
        for m in self.managers:
            found.append(m.lookup(token_ids, keys, n))
            n = m.longest_hit(found[-1], n)
        # A group that serves n blocks may not serve fewer (a ring needs its window whole), so
        # a cut made by a later group is checked again until every group agrees.
        while (most := min(m.longest_hit(f, n) for m, f in zip(self.managers, found))) < n:
            n = most
        return n, found

    def take_prefix(self, tables: BlockTables, hit: PrefixHit) -> int:
        """Start empty ``tables`` with the prefix ``find_prefix`` found; returns its tokens, 0
        when the fresh blocks it needs besides do not fit (then nothing is taken)."""
        n, found = hit
        if not n:
            return 0
        for gi, (m, table) in enumerate(self._each(tables)):
            if not m.take_prefix(table, found[gi], n):
                self.free(tables[:gi])
                return 0
        return n * self.block_size

    def cache_blocks(
        self, tables: BlockTables, token_ids: list[int], keys: list[bytes], num_computed: int,
        num_registered: int,
    ) -> int:  # fmt: skip
        """Register the blocks full of computed tokens from block ``num_registered`` on (in a
        ring, those it still holds); returns how many blocks of the sequence are registered
        now."""
        n = min(num_computed // self.block_size, len(self.block_keys(token_ids, keys)))
        for m, table in self._each(tables):
            m.cache_blocks(table, token_ids, keys, num_computed, num_registered, n)
        return max(n, num_registered)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (held blocks stay with their sequences), in every tier."""
        lower = self.tiers.reset() if self.host_tier else 0
        return lower + sum(pool.reset_cache() for pool in self.pools)

    @property
    def num_cached_host_blocks(self) -> int:
        return sum(p.num_cached for p in self.host_pools) if self.host_tier else 0

    @property
    def num_cached_disk_blocks(self) -> int:
        return sum(p.num_cached for p in self.tiers.disk_pools)

    @property
    def num_total_disk_blocks(self) -> int:
        return sum(p.num_blocks for p in self.tiers.disk_pools)

    # -- context shift ------------------------------------------------------------------------

    def discard_end(self, tables: BlockTables, num_cached: int) -> int:
        """A shift drops only tokens before this position (after the kept ones, in whole
        blocks), such that every window still finds its positions."""
        return min(m.discard_end(len(t), num_cached) for m, t in self._each(tables))

    def discard_end_when_full(self, max_model_len: int) -> int:
        """``discard_end`` of a sequence that has just filled the context (its last token not
        yet cached): what a shift will be able to drop, known from the specs at admission."""
        n, bs = max_model_len - 1, self.block_size
        return min(m.discard_end(m.spec.num_blocks(n, bs), n) for m in self.managers)

    def max_discard(self, tables: BlockTables, num_cached: int, keep: int) -> int:
        """Most tokens a shift can drop after the first ``keep`` (a block multiple)."""
        bs = self.block_size
        return max(0, (self.discard_end(tables, num_cached) - keep) // bs * bs)

    def drop(
        self, tables: BlockTables, num_cached: int, start: int, count: int
    ) -> tuple[BlockTables, BlockPairs]:
        """Remove tokens [start, start + count) from a sequence holding ``num_cached``.

        Returns, per group, the blocks whose keys must then move ``-count`` positions, and the
        copies to make first: a moved block that another sequence shares is replaced by a copy
        (copy-on-write); one the sequence holds alone leaves the prefix cache. Raises
        MemoryError, changing nothing, when there are no free blocks for the copies.
        """
        bs = self.block_size
        if start % bs or count % bs or not 0 < count <= self.max_discard(tables, num_cached, start):
            raise ValueError(f"cannot drop {count} tokens at {start} of {num_cached} cached")
        first, n = start // bs, count // bs
        if not all(m.can_drop(t, first, n) for m, t in self._each(tables)):
            raise MemoryError("no free blocks to copy shared blocks before a shift")
        dropped = [m.drop(t, first, n) for m, t in self._each(tables)]
        return [moved for moved, _ in dropped], [copies for _, copies in dropped]

    # -- eviction by importance -----------------------------------------------------------------

    def evict(self, tables: BlockTables, keep: int) -> BlockTables:
        """Shrink ``tables`` to hold ``keep`` tokens, compacted by the runner from the tables
        as they were (returned, per group); whole blocks go back to the pools. Raises
        MemoryError, changing nothing, when there are no fresh blocks for those it shares."""
        if not all(m.can_evict(t, keep) for m, t in self._each(tables)):
            raise MemoryError("no free blocks to replace shared blocks before an eviction")
        return [m.evict(t, keep) for m, t in self._each(tables)]

    # -- swapping -----------------------------------------------------------------------------

    @property
    def can_swap(self) -> bool:
        return bool(self.host_pools)

    def can_swap_out(self, tables: BlockTables) -> bool:
        return self.can_swap and all(
            len(t) <= pool.num_free for t, pool in zip(tables, self.host_pools)
        )

    def swap_out(self, tables: BlockTables) -> tuple[BlockTables, BlockPairs]:
        """Move a sequence's blocks to the host pools: (host tables, device->host copies)."""
        if not self.can_swap_out(tables):
            raise MemoryError("not enough free swap blocks")
        host_tables, copies = [], []
        for pool, host_pool, table in zip(self.pools, self.host_pools, tables):
            host = host_pool.allocate(len(table))
            copies.append(list(zip(table, host)))
            host_tables.append(host)
            pool.free(table)
            table.clear()
        return host_tables, copies

    def can_swap_in(self, host_tables: BlockTables, num_tokens: int) -> bool:
        """Whether the blocks come back and the sequence can grow to ``num_tokens``."""
        return all(
            max(len(h), g.spec.num_blocks(num_tokens, self.block_size)) <= pool.num_free
            for g, h, pool in zip(self.groups, host_tables, self.pools)
        )

    def swap_in(self, host_tables: BlockTables) -> tuple[BlockTables, BlockPairs]:
        """Bring swapped blocks back: (device tables, host->device copies)."""
        if not all(len(h) <= pool.num_free for h, pool in zip(host_tables, self.pools)):
            raise MemoryError("not enough free KV blocks")
        tables, copies = [], []
        for pool, host_pool, host in zip(self.pools, self.host_pools, host_tables):
            table = pool.allocate(len(host))
            copies.append(list(zip(host, table)))
            tables.append(table)
            # Read by this step's copies: free once they have run (``end_step``).
            self.tiers.pin(host_pool, list(host))
        for host in host_tables:
            host.clear()
        return tables, copies

    def free_host(self, host_tables: BlockTables) -> None:
        for pool, host in zip(self.host_pools, host_tables):
            pool.free(host)
            host.clear()

    # -- accounting ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached for p in self.pools)

    @property
    def num_free_host_blocks(self) -> int:
        return sum(p.num_free for p in self.host_pools)

    @property
    def num_total_host_blocks(self) -> int:
        return sum(p.num_blocks for p in self.host_pools)

    def usage(self) -> list[float]:
        return [p.usage for p in self.pools]

    def check_integrity(
        self, live_tables: list[BlockTables], live_host_tables: list[BlockTables] = ()
    ) -> None:
        """Pools are consistent and every held block is owned by exactly its referents (the
        step's pinned blocks too: their copies hold them)."""

        def pinned(pool: BlockPool) -> list[list[int]]:
            return [blocks for p, blocks in self.tiers.pinned if p is pool]

        for gi, m in enumerate(self.managers):
            tables = [t[gi] for t in live_tables if t] + pinned(m.pool)
            m.check_integrity(tables, f"device group {gi}")
        for gi, pool in enumerate(self.host_pools):
            tables = [t[gi] for t in live_host_tables if t] + pinned(pool)
            check_owners(pool, tables, f"host group {gi}")
