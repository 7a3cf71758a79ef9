"""How many KV blocks each cache group gets, and what that holds."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_spec import KVCacheGroup

GIB = 1 << 30


def split_memory(
    groups: list[KVCacheGroup], memory_bytes: int, block_size: int, max_model_len: int
) -> tuple[int, ...]:
    """Blocks per group, sharing memory in proportion to what a full-length sequence needs."""
    demand = [
        g.spec.table_width(max_model_len, block_size) * g.bytes_per_block(block_size)
        for g in groups
    ]
    total = sum(demand)
    return tuple(
        max(1, int(memory_bytes * d / total) // g.bytes_per_block(block_size))
        for g, d in zip(groups, demand)
    )


@dataclass(frozen=True)
class GroupCapacity:
    kind: str
    num_layers: int
    bytes_per_token: int
    num_blocks: int
    block_size: int
    tokens: int  # token slots in the pool
    max_seqs_at_full_len: int  # sequences of max_model_len that fit at once


def capacity(
    groups: list[KVCacheGroup], num_blocks: tuple[int, ...], block_size: int, max_model_len: int
) -> list[GroupCapacity]:
    rows = []
    for g, n in zip(groups, num_blocks):
        per_seq = g.spec.num_blocks(max_model_len, block_size)
        spec = g.spec
        kind = type(spec).__name__
        if spec.window:
            kind += f"(window={spec.window})"
        rows.append(
            GroupCapacity(
                kind=kind,
                num_layers=len(g.layer_ids),
                bytes_per_token=g.bytes_per_token,
                num_blocks=n,
                block_size=block_size,
                tokens=n * block_size,
                max_seqs_at_full_len=n // max(1, per_seq),
            )
        )
    return rows


def format_capacity(rows: list[GroupCapacity], max_model_len: int) -> str:
    lines = [
        f"{'group':<32} {'layers':>6} {'bytes/token':>12} {'blocks':>8} {'tokens':>10} "
        f"{'seqs@' + str(max_model_len):>10}"
    ]
    for r in rows:
        lines.append(
            f"{r.kind:<32} {r.num_layers:>6} {r.bytes_per_token:>12,} {r.num_blocks:>8} "
            f"{r.tokens:>10,} {r.max_seqs_at_full_len:>10}"
        )
    return "\n".join(lines)
