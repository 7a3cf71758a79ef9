"""One table manager per KV-cache spec: how one group's block tables grow, meet the prefix
cache and lose tokens. Pure Python.

``KVCacheManager`` composes one per group (``table_manager`` picks the class from the spec's
type, as vLLM's ``single_type_kv_cache_manager.py`` does), so that what differs between cache
formats lives in the class of its format and the manager carries no ``if window`` branches.

Full attention (and MLA, whose latent rows are addressed the same way): position p lives in
``table[p // block_size]``; a sequence holds every block of its tokens.

Sliding window, a ring: a sequence holds at most ``ring_len = ceil(window / block_size) + 1``
blocks and position p lives in ``table[(p // block_size) % ring_len]`` (``models.kv_spec``)::

    window 6, block_size 4, ring_len 3; the next token is 13:
    positions:  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13
    ring entry:      0     |      1     |      2     |   0
                                          |----------------|  the window of 13
    positions 12-15 reuse entry 0: positions 0-3 left every window before 12 wrote there

Per format:

- Growing: a ring entry written over while others may still read its block (a cached or
  shared one) gets a fresh block first; full tables only ever append.
- Prefix hits: a full group needs every block of the prefix, each found after its parent. A
  ring needs only the blocks the next token's window reaches; its other entries get fresh
  blocks, never read. A ring's entries have no fixed parent, so it looks each block up alone.
- Drops (a context shift removes whole blocks after the kept ones): a full table loses them and
  the blocks after them hold keys that move down (are re-rotated). A ring that has filled all
  its entries keeps its blocks and turns: renumbering every position by -8 (2 blocks of 4)
  turns the ring by 2 entries::

      ring_len 3: table [a b c] holding positions 12..23 (12-15 in a, 16-19 in b, 20-23 in c)
      after -8:   table [c a b]: positions 4..15 (4-7 in a, 8-11 in b, 12-15 in c)

  That is exact only if no later window reaches back over the discarded range to the kept
  tokens (which a turned ring does not hold): ``discard_end`` bounds the drop to keep it so.
  A ring that has not filled holds every position, and drops blocks like a full table.

A moved block that another sequence shares is copied first (copy-on-write); one the sequence
holds alone leaves the prefix cache, since its keys change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.core.block_pool import BlockPool
from models.kv_spec import FullAttentionSpec, KVSpec, MLASpec, SlidingWindowSpec

BlockPair = tuple[int, int]  # (from block, to block): a copy to make
HOLE = -1  # a ring entry that a prefix hit leaves to a fresh block


class TableManager:
    """One group's tables over its own block pool: what every format shares. The subclasses
    say how a table is addressed, found in the prefix cache, registered in it, and dropped."""

    def __init__(self, spec: KVSpec, block_size: int, num_blocks: int, prefix_caching: bool):
        self.spec = spec
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_caching = prefix_caching

    # -- growing and freeing ------------------------------------------------------------------

    def blocks_needed(self, table: list[int], num_tokens: int, start: int) -> int:
        """Blocks the table must add to hold ``num_tokens``, writing those from ``start`` on."""
        return self._growth(table, num_tokens)

    def allocate(self, table: list[int], num_tokens: int, start: int) -> list[BlockPair]:
        """Grow ``table`` to hold ``num_tokens`` (the caller checked ``blocks_needed``); returns
        the copies to make before the step's tokens are written."""
        table.extend(self.pool.allocate(self._growth(table, num_tokens)))
        return []

    def _growth(self, table: list[int], num_tokens: int) -> int:
        return max(0, self.spec.num_blocks(num_tokens, self.block_size) - len(table))

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.spec.num_blocks(num_tokens, self.block_size) <= self.pool.num_blocks

    def free(self, table: list[int]) -> None:
        self.pool.free(table[::-1])  # the tail is evicted first
        table.clear()

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past those ``num_tokens`` tokens need (rejected drafts')."""
        keep = self.spec.num_blocks(num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(table[keep:][::-1])
            del table[keep:]

    def _give_fresh_block(self, table: list[int], i: int) -> int:
        """Replace ``table[i]`` by a fresh block, dropping one reference to the old one (which
        others may still hold, or the cache keep); returns the old block."""
        old, (table[i],) = table[i], self.pool.allocate(1)
        self.pool.free([old])
        return old

    # -- prefix caching -----------------------------------------------------------------------

    def lookup(self, token_ids: list[int], keys: list[bytes], n: int) -> list[int | None]:
        """The cached blocks for the first ``n`` blocks of ``token_ids`` this group can use."""
        raise NotImplementedError

    def longest_hit(self, found: list[int | None], n: int) -> int:
        """The most blocks, at most ``n``, of a prefix whose ``found`` blocks serve this group."""
        raise NotImplementedError

    def take_prefix(self, table: list[int], found: list[int | None], n: int) -> bool:
        """Start an empty ``table`` with a hit of ``n`` blocks; False, taking nothing, when the
        pool lacks the fresh blocks it needs besides."""
        raise NotImplementedError

    def cache_blocks(
        self, table: list[int], token_ids: list[int], keys: list[bytes], num_computed: int,
        num_registered: int, n: int,
    ) -> None:  # fmt: skip
        """Register the blocks of the sequence's first ``n`` full blocks of computed tokens
        that are not registered yet and that the table still holds. A block whose contents
        another block already holds in the cache (computed alongside) is replaced by it, so
        that the chain of parents stays findable and the copy is freed."""
        pool = self.pool
        for j in self._registrable(num_computed, num_registered, n):
            e, parent, tokens = self._entry(j), self._parent(table, j), self._tokens(token_ids, j)
            found = pool.lookup(keys[j], parent, tokens)
            if found is None:
                pool.register(table[e], keys[j], parent, tokens, keys[j - 1] if j else None)
            elif found != table[e] and pool.private(table[e]):
                pool.take(found)
                pool.free([table[e]])
                table[e] = found

    # What registering reads, for a table in position order (a ring overrides them):

    def _registrable(self, num_computed: int, num_registered: int, n: int) -> range:
        return range(num_registered, n)

    def _entry(self, j: int) -> int:
        """The table entry of the sequence's block ``j``."""
        return j

    def _parent(self, table: list[int], j: int) -> tuple[int, int] | None:
        """What block ``j`` is registered after: the block before it (None for the first)."""
        return self.pool.ident(table[j - 1]) if j else None

    def _tokens(self, token_ids: list[int], j: int) -> tuple[int, ...]:
        """The token ids of the sequence's block ``j``, as the cache keeps them."""
        return tuple(token_ids[j * self.block_size : (j + 1) * self.block_size])

    # -- context shift ------------------------------------------------------------------------

    def discard_end(self, num_held: int, num_cached: int) -> int:
        """A drop removes tokens before this position only, for a table of ``num_held`` blocks
        holding ``num_cached`` tokens: whole blocks of cached tokens."""
        return num_cached // self.block_size * self.block_size

    def can_drop(self, table: list[int], first: int, n: int) -> bool:
        """Whether the pool has the fresh blocks that dropping blocks [first, first + n) needs
        for its copies."""
        raise NotImplementedError

    def drop(self, table: list[int], first: int, n: int) -> tuple[list[int], list[BlockPair]]:
        """Drop blocks [first, first + n) (``can_drop`` said yes): (the blocks whose keys then
        move down, the copies to make first)."""
        raise NotImplementedError

    def _can_remove(self, table: list[int], first: int, n: int) -> bool:
        shared = sum(self.pool.ref_counts[b] > 1 for b in table[first + n :])
        freed = sum(self.pool.ref_counts[b] == 1 for b in table[first : first + n])
        return shared <= self.pool.num_free + freed

    def _remove(self, table: list[int], first: int, n: int) -> tuple[list[int], list[BlockPair]]:
        """Blocks [first, first + n) leave the table; those after them move down."""
        self.pool.free(table[first : first + n][::-1])
        del table[first : first + n]
        return self._move(table, first)

    def _move(self, table: list[int], start: int) -> tuple[list[int], list[BlockPair]]:
        """The keys of ``table[start:]`` are about to move: a shared block is replaced by a
        copy (copy-on-write), one held alone leaves the prefix cache."""
        copies = []
        for i in range(start, len(table)):
            if self.pool.ref_counts[table[i]] > 1:
                copies.append((self._give_fresh_block(table, i), table[i]))
            else:
                self.pool.uncache(table[i])
        return table[start:], copies

    # -- eviction -----------------------------------------------------------------------------

    def can_evict(self, table: list[int], keep: int) -> bool:
        """Whether the pool has the fresh blocks that compacting to ``keep`` tokens needs."""
        n = self.spec.num_blocks(keep, self.block_size)
        shared = sum(self.pool.ref_counts[b] > 1 for b in table[:n])
        freed = sum(self.pool.ref_counts[b] == 1 for b in table[n:])
        return shared <= self.pool.num_free + freed

    def evict(self, table: list[int], keep: int) -> list[int]:
        """Shrink ``table`` to hold ``keep`` tokens, which the runner then writes anew from
        the table as it was (returned): the blocks past them go back to the pool, a kept block
        another sequence shares is replaced by a fresh one, and one held alone leaves the
        prefix cache. The old blocks are read before any is written over."""
        old = list(table)
        n = self.spec.num_blocks(keep, self.block_size)
        self.pool.free(table[n:][::-1])
        del table[n:]
        for i, b in enumerate(table):
            if self.pool.ref_counts[b] > 1:
                self._give_fresh_block(table, i)
            else:
                self.pool.uncache(b)
        return old

    # -- accounting ---------------------------------------------------------------------------

    def check_integrity(self, tables: Iterable[list[int]], name: str = "") -> None:
        """The pool is consistent, each block is held by exactly its referents (``tables``:
        every live table of the group), and no table is longer than its format allows."""
        tables = list(tables)
        check_owners(self.pool, tables, f"{name or type(self).__name__}")
        for table in tables:
            assert len(table) <= self._max_len(), f"a table of {len(table)} blocks"

    def _max_len(self) -> int:
        return self.pool.num_blocks


class FullAttentionManager(TableManager):
    """Full attention, and MLA: an MLA group's latent rows are addressed, cached and dropped
    exactly as full attention's keys and values are, so it shares this class."""

    def lookup(self, token_ids: list[int], keys: list[bytes], n: int) -> list[int | None]:
        """Each block found after its parent; the first miss ends the hit."""
        found, parent = [], None
        for j in range(n):
            b = self.pool.lookup(keys[j], parent, self._tokens(token_ids, j))
            if b is None:
                break
            found.append(b)
            parent = self.pool.ident(b)
        return found

    def longest_hit(self, found: list[int | None], n: int) -> int:
        return min(n, len(found))

    def take_prefix(self, table: list[int], found: list[int | None], n: int) -> bool:
        for b in found[:n]:
            self.pool.take(b)
        table.extend(found[:n])
        return True

    def can_drop(self, table: list[int], first: int, n: int) -> bool:
        return self._can_remove(table, first, n)

    def drop(self, table: list[int], first: int, n: int) -> tuple[list[int], list[BlockPair]]:
        return self._remove(table, first, n)


class SlidingWindowManager(TableManager):
    """A sliding window as a ring of ``ring_len`` blocks (see the module docstring)."""

    spec: SlidingWindowSpec

    def __init__(
        self, spec: SlidingWindowSpec, block_size: int, num_blocks: int, prefix_caching: bool
    ):
        super().__init__(spec, block_size, num_blocks, prefix_caching)
        self.window = spec.window_size
        self.ring_len = spec.ring_len(block_size)

    def _is_full(self, num_held: int) -> bool:
        """Whether the ring uses all its entries: positions then wrap around it."""
        return num_held >= self.ring_len

    def _max_len(self) -> int:
        return self.ring_len

    # -- growing ------------------------------------------------------------------------------

    def blocks_needed(self, table: list[int], num_tokens: int, start: int) -> int:
        return self._growth(table, num_tokens) + len(self._fresh_entries(table, start, num_tokens))

    def allocate(self, table: list[int], num_tokens: int, start: int) -> list[BlockPair]:
        """Entries that tokens from ``start`` on write over, while others may still read them
        (cached or shared blocks), get fresh blocks; the copies are those whose old contents
        this step's own tokens still read."""
        copies = []
        for e, copy in self._fresh_entries(table, start, num_tokens):
            old = self._give_fresh_block(table, e)
            if copy:
                copies.append((old, table[e]))
        return copies + super().allocate(table, num_tokens, start)

    def _fresh_entries(
        self, table: list[int], start: int, num_tokens: int
    ) -> list[tuple[int, bool]]:
        """The entries that tokens [start, num_tokens) write over whose blocks must stay as
        they are (registered in the cache, or shared), and whether the step's first token
        still reads the block there (a long prefill chunk: the contents are copied over)."""
        if not self.prefix_caching or num_tokens <= start:
            return []  # without a cache, every block is its sequence's alone
        bs, ring = self.block_size, self.ring_len
        first, last = start // bs, (num_tokens - 1) // bs
        out = {}
        for j in range(first, min(last, first + ring - 1) + 1):
            e = j % ring
            if e < len(table) and not self.pool.private(table[e]):
                out[e] = (j - ring + 1) * bs - 1 >= start + 1 - self.window
        return sorted(out.items())

    # -- prefix caching -----------------------------------------------------------------------

    def _window_blocks(self, num_tokens: int) -> range:
        """The blocks of a ``num_tokens`` prefix the next token's window reaches."""
        bs = self.block_size
        return range(max(0, (num_tokens + 1 - self.window) // bs), num_tokens // bs)

    def lookup(self, token_ids: list[int], keys: list[bytes], n: int) -> list[int | None]:
        """Each block alone (None where it is not cached): only the window must be whole."""
        return [self.pool.lookup(keys[j], None, self._tokens(token_ids, j)) for j in range(n)]

    def longest_hit(self, found: list[int | None], n: int) -> int:
        while n and any(found[j] is None for j in self._window_blocks(n * self.block_size)):
            n -= 1
        return n

    def take_prefix(self, table: list[int], found: list[int | None], n: int) -> bool:
        table.extend([HOLE] * min(n, self.ring_len))
        for j in self._window_blocks(n * self.block_size):
            table[j % self.ring_len] = found[j]
            self.pool.take(found[j])
        holes = [e for e, b in enumerate(table) if b == HOLE]
        if len(holes) > self.pool.num_free:
            self.pool.free([b for b in table[::-1] if b != HOLE])
            table.clear()
            return False
        for e, b in zip(holes, self.pool.allocate(len(holes))):
            table[e] = b
        return True

    def _registrable(self, num_computed: int, num_registered: int, n: int) -> range:
        # Blocks that left the ring hold other positions now: too late to register them.
        held_from = -(-num_computed // self.block_size) - self.ring_len
        return range(max(num_registered, held_from), n)

    def _entry(self, j: int) -> int:
        return j % self.ring_len

    def _parent(self, table: list[int], j: int) -> tuple[int, int] | None:
        return None  # the entry before may hold a later block: only the keys chain

    # -- context shift ------------------------------------------------------------------------

    def discard_end(self, num_held: int, num_cached: int) -> int:
        end = super().discard_end(num_held, num_cached)
        if not self._is_full(num_held):
            return end
        # The next token's window, [n - window + 1, n], must not reach the kept tokens.
        return min(end, num_cached - (self.window - 1))

    def can_drop(self, table: list[int], first: int, n: int) -> bool:
        if not self._is_full(len(table)):
            return self._can_remove(table, first, n)
        return sum(self.pool.ref_counts[b] > 1 for b in table) <= self.pool.num_free

    def drop(self, table: list[int], first: int, n: int) -> tuple[list[int], list[BlockPair]]:
        if not self._is_full(len(table)):
            return self._remove(table, first, n)
        turn = n % len(table)
        table[:] = table[turn:] + table[:turn]
        return self._move(table, 0)


# MLA shares full attention's class: see FullAttentionManager. Looked up by exact type, since
# SlidingWindowSpec is a FullAttentionSpec to the type system.
MANAGERS: dict[type, type[TableManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MLASpec: FullAttentionManager,
}


def table_manager(
    spec: KVSpec, block_size: int, num_blocks: int, prefix_caching: bool
) -> TableManager:
    return MANAGERS[type(spec)](spec, block_size, num_blocks, prefix_caching)


def check_owners(pool: BlockPool, tables: Iterable[list[int]], what: str) -> None:
    """``pool`` is consistent and every held block is held by exactly its referents."""
    pool.check_integrity()
    owners = Counter(b for table in tables for b in table)
    for b, refs in enumerate(pool.ref_counts):
        assert owners.get(b, 0) == refs, f"{what} block {b}: {refs} refs, {owners.get(b, 0)} owners"
