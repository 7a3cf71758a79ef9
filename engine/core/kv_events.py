"""What the prefix cache did, as a cluster router reads it: vLLM's KV events. Pure Python.

A block pool (``block_pool.BlockPool``) given an ``EventLog`` records each block it registers
(``BlockStored``), each registered block whose contents it gives up (``BlockRemoved``) and each
reset of its cache (``AllBlocksCleared``), in the order they happen. The engine takes a step's
events once the step is done (``take``) and publishes them (``engine.kv_events``).

The fields are vLLM's (``vllm/distributed/kv_events.py``): a block's hash is the low 8 bytes of
kvserve's block key read big-endian (an unsigned 64-bit integer, as vLLM sends by default), its
parent the hash of the block before it in the sequence (None for the first), ``token_ids`` the
tokens of every block the event stores, in order. Consecutive blocks of one chain registered one
after another become one event, parents always announced before their children (a router skips
a block whose parent it does not know). ``medium`` is ``"GPU"`` for the device pool, whatever
the device: routers weigh that tier first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE = "GPU"
HOST = "CPU"
STORAGE = "STORAGE"


def external_hash(key: bytes) -> int:
    """A block key as vLLM's events carry block hashes: its last 8 bytes, big-endian."""
    return int.from_bytes(key[-8:], "big")


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE
    group_idx: int = 0


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str = DEVICE
    group_idx: int = 0


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventLog:
    """A step's events, in order, consecutive ones of a kind merged where vLLM would send them
    as one: blocks stored down one chain, blocks removed, a reset of several pools."""

    block_size: int
    events: list[KVEvent] = field(default_factory=list)

    def stored(
        self, key: bytes, parent_key: bytes | None, token_ids, group: int, medium: str = DEVICE
    ) -> None:
        """A block registered in a tier's pool. A lower tier's block was announced on the
        device first: it carries no tokens (a router maps it by its hash)."""
        block = external_hash(key)
        parent = None if parent_key is None else external_hash(parent_key)
        tokens = list(token_ids) if medium == DEVICE else []
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and (last.group_idx, last.medium) == (group, medium)
                and parent is not None and last.block_hashes[-1] == parent):  # fmt: skip
            last.block_hashes.append(block)
            last.token_ids.extend(tokens)
            return
        self.events.append(BlockStored([block], parent, tokens, self.block_size, medium, group))

    def removed(self, key: bytes, group: int, medium: str = DEVICE) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and (last.group_idx, last.medium) == (group, medium):
            last.block_hashes.append(external_hash(key))
            return
        self.events.append(BlockRemoved([external_hash(key)], medium, group))

    def cleared(self) -> None:
        if not self.events or not isinstance(self.events[-1], AllBlocksCleared):
            self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events so far, which the log then forgets."""
        events, self.events = self.events, []
        return events
