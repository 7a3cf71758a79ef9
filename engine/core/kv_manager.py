"""Per-sequence block tables over one block pool per KV-cache group. Pure Python.

Besides growing and freeing tables, the manager carries out two cache moves and describes the
copies or rotations they need; the model runner performs them before the step's forward pass:

- ``drop``: a context shift removes whole blocks of tokens after the kept ones. A full table
  loses those blocks and the blocks after them hold keys that must move down (be re-rotated)::

      block_size 4, keep 4, drop 8:   table [a b c d e]  ->  [a d e]   rotate d, e by -8

  A sliding-window ring that has filled all ``ring_len`` entries keeps its blocks: the
  discarded positions are outside any later window, and renumbering every position by -8 is
  turning the ring by 8 / 4 entries (position p lives in ``table[(p // bs) % ring_len]``)::

      ring_len 3: table [a b c] holding positions 12..23 (12-15 in a, 16-19 in b, 20-23 in c)
      after -8:   table [c a b]: positions 4..15 (4-7 in c, 8-11 in a, 12-15 in b)

  That is exact only if no later window reaches back over the discarded range to the kept
  tokens (which a turned ring does not hold); ``max_discard`` bounds the drop to keep it so.
  A ring that has not filled holds every position, and drops blocks like a full table.
- ``swap_out`` / ``swap_in``: a preempted sequence's blocks go to a host pool and come back
  into fresh device blocks, in table order (which a ring's addressing depends on).

Prefix caching (``BlockPool`` keeps the cache): a sequence's full blocks of computed tokens are
registered under chained keys of its token ids (``cache_blocks``), and a new sequence starts
with a cached prefix of whole blocks (``find_prefix``), shared with reference counts:

- A full (or MLA) group needs every block of the prefix, each found after its parent block.
- A sliding-window group needs only the blocks of the prefix that the next token's window
  reaches (its other ring entries get fresh blocks, never read). A ring overwrites the entry
  of a block that left the window; a cached or shared block is never written over, but leaves
  the ring for a fresh block, so it stays findable for others (``allocate``).
- The hit is the longest prefix every group can serve. For Gemma 3 that is the longest run of
  cached blocks whose last window is still cached in the local layers' pool too.

A shift copies a shared block before its keys are rotated (copy-on-write), and a block that is
rotated in place leaves the cache.
"""

from __future__ import annotations

from collections import Counter

from engine.core.block_pool import BlockPool, block_hash
from engine.core.config import CacheConfig
from models.kv_spec import KVCacheGroup

BlockTables = list[list[int]]  # one table per group
BlockPairs = list[list[tuple[int, int]]]  # per group: (from block, to block)


class KVCacheManager:
    def __init__(self, config: CacheConfig):
        self.config = config
        self.groups = config.groups
        self.pools = [BlockPool(n) for n in config.num_blocks]
        self.host_pools = [BlockPool(n) for n in config.num_host_blocks]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_tables(self) -> BlockTables:
        return [[] for _ in self.groups]

    def blocks_needed(self, tables: BlockTables, num_tokens: int, start: int = 0) -> list[int]:
        """Blocks each group must add for the sequence to hold ``num_tokens`` tokens, writing
        those from ``start`` on."""
        return [
            max(0, g.spec.num_blocks(num_tokens, self.block_size) - len(t))
            + len(self._fresh_entries(g, pool, t, start, num_tokens))
            for g, pool, t in zip(self.groups, self.pools, tables)
        ]

    def can_allocate(self, tables: BlockTables, num_tokens: int, start: int = 0) -> bool:
        needed = self.blocks_needed(tables, num_tokens, start)
        return all(n <= pool.num_free for n, pool in zip(needed, self.pools))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the pools when they are empty."""
        return all(
            g.spec.num_blocks(num_tokens, self.block_size) <= pool.num_blocks
            for g, pool in zip(self.groups, self.pools)
        )

    def allocate(self, tables: BlockTables, num_tokens: int, start: int = 0) -> BlockPairs:
        """Grow ``tables`` in place to hold ``num_tokens``; all groups or none. Ring entries
        that tokens from ``start`` on will write over, while others may still read them (cached
        or shared blocks), get fresh blocks; returns per group the copies to make first (old
        block, fresh block) where this step's own tokens still read the old contents."""
        needed = self.blocks_needed(tables, num_tokens, start)
        if not all(n <= pool.num_free for n, pool in zip(needed, self.pools)):
            raise MemoryError("not enough free KV blocks")
        copies = []
        for g, pool, table in zip(self.groups, self.pools, tables):
            pairs = []
            for e, copy in self._fresh_entries(g, pool, table, start, num_tokens):
                old = _give_fresh_block(pool, table, e)
                if copy:
                    pairs.append((old, table[e]))
            grow = g.spec.num_blocks(num_tokens, self.block_size) - len(table)
            table.extend(pool.allocate(max(0, grow)))
            copies.append(pairs)
        return copies

    def _fresh_entries(
        self, g: KVCacheGroup, pool: BlockPool, table: list[int], start: int, num_tokens: int
    ) -> list[tuple[int, bool]]:
        """The ring entries that tokens [start, num_tokens) write over whose blocks must stay
        as they are (registered in the cache, or shared), and whether the step's first token
        still reads the block there (a long prefill chunk: the contents are copied over)."""
        if not g.spec.window or not self.prefix_caching or num_tokens <= start:
            return []
        bs, ring = self.block_size, g.spec.ring_len(self.block_size)
        first, last = start // bs, (num_tokens - 1) // bs
        out = {}
        for j in range(first, min(last, first + ring - 1) + 1):
            e = j % ring
            if e < len(table) and not pool.private(table[e]):
                out[e] = (j - ring + 1) * bs - 1 >= start + 1 - g.spec.window
        return sorted(out.items())

    def free(self, tables: BlockTables) -> None:
        for pool, table in zip(self.pools, tables):
            pool.free(table[::-1])  # the tail is evicted first
            table.clear()

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

    def _window_blocks(self, g: KVCacheGroup, num_tokens: int) -> range:
        """The blocks of a ``num_tokens`` prefix the next token's window reaches."""
        bs = self.block_size
        return range(max(0, (num_tokens + 1 - g.spec.window) // bs), num_tokens // bs)

    def find_prefix(
        self, token_ids: list[int], keys: list[bytes], max_tokens: int
    ) -> tuple[int, list[list[int | None]]]:
        """The longest prefix of whole blocks of ``token_ids`` (at most ``max_tokens`` tokens)
        that every group can serve from the cache: (its blocks, per group the cached block of
        each of its blocks, None where a sliding-window group has none)."""
        bs = self.block_size
        n = min(max_tokens // bs, len(keys))
        found: list[list[int | None]] = []
        for g, pool in zip(self.groups, self.pools):
            blocks, parent = [], None
            for j in range(n):
                tokens = tuple(token_ids[j * bs : (j + 1) * bs])
                b = pool.lookup(keys[j], None if g.spec.window else parent, tokens)
                if b is None and not g.spec.window:
                    break
                blocks.append(b)
                parent = None if b is None else pool.ident(b)
            found.append(blocks)
            if not g.spec.window:
                n = len(blocks)
        for g, blocks in zip(self.groups, found):
            if g.spec.window:
                while n and any(blocks[j] is None for j in self._window_blocks(g, n * bs)):
                    n -= 1
        return n, found

    def take_prefix(self, tables: BlockTables, hit: tuple[int, list[list[int | None]]]) -> int:
        """Start empty ``tables`` with the prefix ``find_prefix`` found (fresh blocks in the
        ring entries no window reads); returns its tokens, 0 when the fresh blocks do not fit
        (then nothing is taken)."""
        n, found = hit
        if not n:
            return 0
        bs = self.block_size
        for g, pool, table, blocks in zip(self.groups, self.pools, tables, found):
            if not g.spec.window:
                for b in blocks[:n]:
                    pool.take(b)
                table.extend(blocks[:n])
                continue
            ring = g.spec.ring_len(bs)
            table.extend([-1] * min(n, ring))
            for j in self._window_blocks(g, n * bs):
                table[j % ring] = blocks[j]
                pool.take(blocks[j])
        for pool, table in zip(self.pools, tables):
            fresh = [e for e, b in enumerate(table) if b < 0]
            if len(fresh) > pool.num_free:
                for p, t in zip(self.pools, tables):
                    p.free([b for b in t[::-1] if b >= 0])
                    t.clear()
                return 0
            for e, b in zip(fresh, pool.allocate(len(fresh))):
                table[e] = b
        return n * bs

    def cache_blocks(
        self, tables: BlockTables, token_ids: list[int], keys: list[bytes], num_computed: int,
        num_registered: int,
    ) -> int:  # fmt: skip
        """Register the blocks full of computed tokens from block ``num_registered`` on (in a
        ring, those it still holds); returns how many blocks of the sequence are registered
        now. A block whose contents another block already holds in the cache (computed
        alongside) is replaced by it, so that the chain of parents stays findable and the copy
        is freed."""
        bs = self.block_size
        n = min(num_computed // bs, len(self.block_keys(token_ids, keys)))
        for g, pool, table in zip(self.groups, self.pools, tables):
            ring = g.spec.ring_len(bs) if g.spec.window else 0
            first = max(num_registered, -(-num_computed // bs) - ring) if ring else num_registered
            for j in range(first, n):
                e = j % ring if ring else j
                parent = None if ring or not j else pool.ident(table[j - 1])
                tokens = tuple(token_ids[j * bs : (j + 1) * bs])
                found = pool.lookup(keys[j], parent, tokens)
                if found is None:
                    pool.register(table[e], keys[j], parent, tokens)
                elif found != table[e] and pool.private(table[e]):
                    pool.take(found)
                    pool.free([table[e]])
                    table[e] = found
        return max(n, num_registered)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (held blocks stay with their sequences)."""
        return sum(pool.reset_cache() for pool in self.pools)

    # -- context shift ------------------------------------------------------------------------

    def _ring_is_full(self, group: KVCacheGroup, table: list[int]) -> bool:
        return group.spec.window > 0 and len(table) >= group.spec.ring_len(self.block_size)

    def max_discard(self, tables: BlockTables, num_cached: int, keep: int) -> int:
        """Most tokens a shift can drop after the first ``keep`` (a block multiple), in whole
        blocks of cached tokens, such that every window still finds its positions."""
        bs = self.block_size
        most = num_cached // bs * bs - keep
        for g, table in zip(self.groups, tables):
            if self._ring_is_full(g, table):
                # The next token's window, [n - window + 1, n], must not reach the kept tokens.
                most = min(most, num_cached - keep - (g.spec.window - 1))
        return max(0, most // bs * bs)

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
        for g, pool, table in zip(self.groups, self.pools, tables):
            ring = self._ring_is_full(g, table)
            shared = sum(pool.ref_counts[b] > 1 for b in (table if ring else table[first + n :]))
            freed = 0 if ring else sum(pool.ref_counts[b] == 1 for b in table[first : first + n])
            if shared > pool.num_free + freed:
                raise MemoryError("no free blocks to copy shared blocks before a shift")
        moved, copies = [], []
        for g, pool, table in zip(self.groups, self.pools, tables):
            pairs = []
            if self._ring_is_full(g, table):
                turn = n % len(table)
                table[:] = table[turn:] + table[:turn]
                start_moved = 0
            else:
                pool.free(table[first : first + n][::-1])
                del table[first : first + n]
                start_moved = first
            for i in range(start_moved, len(table)):
                b = table[i]
                if pool.ref_counts[b] > 1:
                    pairs.append((_give_fresh_block(pool, table, i), table[i]))
                else:
                    pool.uncache(b)
            moved.append(table[start_moved:])
            copies.append(pairs)
        return moved, copies

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
            host_pool.free(host)
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
        """Pools are consistent and every held block is owned by exactly its referents."""
        for pools, owners_tables, kind in (
            (self.pools, live_tables, "device"),
            (self.host_pools, live_host_tables, "host"),
        ):
            for gi, pool in enumerate(pools):
                pool.check_integrity()
                owners = Counter(b for tables in owners_tables if tables for b in tables[gi])
                for b, refs in enumerate(pool.ref_counts):
                    assert owners.get(b, 0) == refs, (
                        f"{kind} group {gi} block {b}: {refs} refs, {owners.get(b, 0)} owners"
                    )


def _give_fresh_block(pool: BlockPool, table: list[int], i: int) -> int:
    """Replace ``table[i]`` by a fresh block, dropping one reference to the old one (which
    others may still hold, or the cache keep); returns the old block."""
    old, (table[i],) = table[i], pool.allocate(1)
    pool.free([old])
    return old
