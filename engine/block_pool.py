"""A pool of fixed-size KV blocks: ref counts and a free list. Pure Python."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, listed once) or held (ref > 0, not listed)."""
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is listed free twice"
        for b, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"block {b} has ref count {refs}"
            assert (refs == 0) == (b in free), f"block {b}: ref count {refs}, free={b in free}"
