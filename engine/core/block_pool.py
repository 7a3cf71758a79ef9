"""A pool of fixed-size KV blocks: ref counts, free blocks in LRU order, cached full blocks.

Prefix caching: a full block whose contents are final is *registered* under a key that chains
its parent's key with its token ids (``block_hash``). Freed blocks keep their contents and stay
findable until they are handed out again, least recently freed first. A lookup is verified,
never trusted from the key alone: the block must hold the same token ids and follow the same
parent block (identified with a generation count that changes whenever a block's contents stop
being the registered ones), so a key collision cannot serve another prefix's keys and values.
Given an ``events`` log (``kv_events.EventLog``), the pool records what a cluster router must
know: each block registered, each registered block given up, each reset. Pure Python.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from engine.core.kv_events import DEVICE, EventLog

Parent = tuple[int, int] | None  # (block id, generation) of the block before, None for the first


def block_hash(parent_key: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The key of a full block: a cryptographic hash of its parent's key and its token ids."""
    h = hashlib.blake2b(parent_key or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first: the next handed out, evicting its cache entry.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.generation = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block
        self.entry: list[tuple[bytes, Parent, tuple[int, ...]] | None] = [None] * num_blocks
        self.events: EventLog | None = None  # set by the KV manager when events are published
        self.group = 0  # the KV-cache group, as events name it
        self.medium = DEVICE  # the tier, as events name it
        # Called with (block, its cache entry) before a cached block is handed out again (the
        # KV manager writes it down to a lower tier).
        self.on_evict: Callable[[int, tuple[bytes, Parent, tuple[int, ...]]], None] | None = None
        # Called with (block, its cache entry) once a block is registered (write-through).
        self.on_register: Callable[[int, tuple[bytes, Parent, tuple[int, ...]]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free_blocks.popitem(last=False)
            if self.on_evict is not None and self.entry[b] is not None:
                self.on_evict(b, self.entry[b])
            self.uncache(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each; a block no one holds becomes free (and stays cached).
        Pass a sequence's blocks last first, so that its tail is evicted before its head."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None

    # -- prefix caching -----------------------------------------------------------------------

    def private(self, block: int) -> bool:
        """Held by one sequence and not in the cache: its owner may write over it."""
        return self.ref_counts[block] == 1 and self.entry[block] is None

    def ident(self, block: int) -> Parent:
        return block, self.generation[block]

    def register(
        self,
        block: int,
        key: bytes,
        parent: Parent,
        token_ids: tuple[int, ...],
        parent_key: bytes | None = None,
    ) -> None:
        """Make a held, full block findable under ``key`` (no-op if the key is taken);
        ``parent_key`` is the key ``key`` chains from, for the events."""
        if key in self.cached or self.entry[block] is not None:
            return
        self.cached[key] = block
        self.entry[block] = (key, parent, token_ids)
        if self.events is not None:
            self.events.stored(key, parent_key, token_ids, self.group, self.medium)
        if self.on_register is not None:
            self.on_register(block, self.entry[block])

    def lookup(self, key: bytes, parent: Parent, token_ids: tuple[int, ...]) -> int | None:
        """The cached block for ``key`` if it holds ``token_ids`` after ``parent``."""
        block = self.cached.get(key)
        if block is None or self.entry[block] != (key, parent, token_ids):
            return None
        return block

    def take(self, block: int) -> None:
        """One more reference to a cached block found by ``lookup`` (free or held)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def uncache(self, block: int) -> None:
        """Forget a block's cache entry: its contents are about to change."""
        entry = self.entry[block]
        if entry is not None:
            del self.cached[entry[0]]
            self.entry[block] = None
            self.generation[block] += 1
            if self.events is not None:
                self.events.removed(entry[0], self.group, self.medium)

    def reset_cache(self) -> int:
        """Forget every cache entry (one ``AllBlocksCleared`` event, not one per block);
        returns how many there were."""
        n, events, self.events = len(self.cached), self.events, None
        for block in list(self.cached.values()):
            self.uncache(block)
        self.events = events
        if events is not None:
            events.cleared()
        return n

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, listed once) or held (ref > 0, not listed), and
        every cache entry names a block that carries it."""
        for b, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"block {b} has ref count {refs}"
            free = b in self.free_blocks
            assert (refs == 0) == free, f"block {b}: ref count {refs}, free={free}"
        for key, b in self.cached.items():
            assert self.entry[b] is not None and self.entry[b][0] == key, f"block {b}: stale key"
        assert sum(e is not None for e in self.entry) == len(self.cached), "an orphan entry"
