"""The engine's configuration objects, built once from ``EngineArgs``; derived values are
properties. ``CacheConfig`` is the KV cache's layout: the one place ``block_size`` and the pool
sizes live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from models.kv_spec import KVCacheGroup

GIB = 1 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"  # or "swap"
    max_overflow_tokens: int | None = None  # tokens shift/sink may discard from one request


@dataclass(frozen=True)
class CacheConfig:
    """The model's KV-cache groups, the block size, and one pool size per group (device, and
    host for swapping and the host tier: empty when there is no host pool)."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    num_blocks: tuple[int, ...]
    num_host_blocks: tuple[int, ...] = ()
    prefix_caching: bool = False  # share and keep full blocks of identical prefixes
    # Prefix blocks the device pools evict are written down to the host pools (which swap
    # shares), and found there again (``kv_manager``).
    host_tier: bool = False
    # Under the host tier, a disk tier of this many blocks per group (``kv_tiers``).
    num_disk_blocks: tuple[int, ...] = ()
    # Prefix blocks copied to the host tier once computed, not when the device evicts them.
    write_through: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if len(self.num_blocks) != len(self.groups):
            raise ValueError("one pool size per KV-cache group")
        if self.num_host_blocks and len(self.num_host_blocks) != len(self.groups):
            raise ValueError("one swap pool size per KV-cache group")
        if self.host_tier and not (self.prefix_caching and self.num_host_blocks):
            raise ValueError("a host tier needs prefix caching and host blocks")
        if self.num_disk_blocks and not (
            self.host_tier and len(self.num_disk_blocks) == len(self.groups)
        ):
            raise ValueError("a disk tier needs a host tier and one pool size per group")
        if self.write_through and not self.host_tier:
            raise ValueError("write-through needs a host tier")

    def bytes_per_block(self, group: KVCacheGroup) -> int:
        return group.bytes_per_token * self.block_size

    def blocks_per_seq(self, group: KVCacheGroup, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds in ``group``."""
        return group.spec.num_blocks(num_tokens, self.block_size)


def split_memory(
    groups: tuple[KVCacheGroup, ...],
    memory_bytes: int,
    block_size: int,
    max_model_len: int,
    overhead: int = 0,
) -> tuple[int, ...]:
    """Blocks per group, sharing memory in proportion to what a full-length sequence needs
    (``overhead``: bytes each block takes beyond its keys and values, a disk file's header)."""
    block_bytes = [g.bytes_per_token * block_size + overhead for g in groups]
    demand = [
        g.spec.table_width(max_model_len, block_size) * b for g, b in zip(groups, block_bytes)
    ]
    total = sum(demand)
    return tuple(max(1, int(memory_bytes * d / total) // b) for d, b in zip(demand, block_bytes))
