"""Per-sequence block tables over one block pool per KV-cache group. Pure Python."""

from __future__ import annotations

from collections import Counter

from engine.block_pool import BlockPool
from engine.kv_spec import KVCacheGroup

BlockTables = list[list[int]]  # one table per group


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroup], num_blocks: tuple[int, ...], block_size: int):
        if len(groups) != len(num_blocks):
            raise ValueError("one pool size per KV-cache group")
        self.groups = groups
        self.block_size = block_size
        self.pools = [BlockPool(n) for n in num_blocks]

    def new_tables(self) -> BlockTables:
        return [[] for _ in self.groups]

    def blocks_needed(self, tables: BlockTables, num_tokens: int) -> list[int]:
        """Blocks each group must add for the sequence to hold ``num_tokens`` tokens."""
        return [
            max(0, g.spec.num_blocks(num_tokens, self.block_size) - len(t))
            for g, t in zip(self.groups, tables)
        ]

    def can_allocate(self, tables: BlockTables, num_tokens: int) -> bool:
        needed = self.blocks_needed(tables, num_tokens)
        return all(n <= pool.num_free for n, pool in zip(needed, self.pools))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the pools when they are empty."""
        return all(
            g.spec.num_blocks(num_tokens, self.block_size) <= pool.num_blocks
            for g, pool in zip(self.groups, self.pools)
        )

    def allocate(self, tables: BlockTables, num_tokens: int) -> None:
        """Grow ``tables`` in place to hold ``num_tokens``; all groups or none."""
        needed = self.blocks_needed(tables, num_tokens)
        if not all(n <= pool.num_free for n, pool in zip(needed, self.pools)):
            raise MemoryError("not enough free KV blocks")
        for n, pool, table in zip(needed, self.pools, tables):
            table.extend(pool.allocate(n))

    def free(self, tables: BlockTables) -> None:
        for pool, table in zip(self.pools, tables):
            pool.free(table)
            table.clear()

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    def usage(self) -> list[float]:
        return [p.usage for p in self.pools]

    def check_integrity(self, live_tables: list[BlockTables]) -> None:
        """Pools are consistent and every held block is owned by exactly its referents."""
        for gi, pool in enumerate(self.pools):
            pool.check_integrity()
            owners = Counter(b for tables in live_tables for b in tables[gi])
            for b, refs in enumerate(pool.ref_counts):
                assert owners.get(b, 0) == refs, (
                    f"group {gi} block {b}: {refs} refs, {owners.get(b, 0)} owners"
                )
