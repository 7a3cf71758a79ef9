"""A step's flat inputs, built with a handful of array operations whatever the batch size.

The scheduler's output is plain Python data (token ids, start positions, block tables). The
forward pass needs it flat: the new tokens and their positions, and per KV-cache group the
padded block tables, each token's cache slot and each sequence's length. Built in numpy, the
cost per step does not grow with a Python loop of tensor calls per sequence; on a GPU the whole
step travels in one pinned host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.core.scheduler import ScheduledRequest
from models.kv_spec import KVCacheGroup

NO_SCORES = np.iinfo(np.int32).max  # a sequence none of whose rows accumulates scores


@dataclass
class GroupArrays:
    block_tables: np.ndarray  # [B, width] int32, zero-padded
    slot_mapping: np.ndarray  # [tokens] int64; -1: not written
    seq_lens: np.ndarray  # [B] int32


@dataclass
class StepArrays:
    input_ids: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    prefix_lens: np.ndarray  # [B] int32
    groups: list[GroupArrays]
    # [B] int32: rows at or after this slot accumulate attention scores; None: no row does.
    score_from: np.ndarray | None = None

    @property
    def sample_rows(self) -> np.ndarray:
        """Each sequence's last token's row."""
        return self.cu_seqlens_q[1:] - 1


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    """Lists of at most ``width`` ints as a zero-padded [len(rows), width] int32 array."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.zeros((len(rows), width), dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = np.fromiter(
        chain.from_iterable(rows), dtype=np.int32, count=int(lens.sum())
    )
    return out


def step_arrays(
    scheduled: list[ScheduledRequest], groups: list[KVCacheGroup], block_size: int
) -> StepArrays:
    bs = block_size
    n = len(scheduled)
    counts = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=n)
    seq_lens = starts + counts
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    ids = np.fromiter(chain.from_iterable(s.token_ids for s in scheduled), np.int64, total)
    row = np.repeat(np.arange(n), counts)  # each token's sequence
    positions = np.arange(total) - cu[:-1][row] + starts[row]  # cache slots
    out = []
    for gi, group in enumerate(groups):
        tables = [s.block_tables[gi] for s in scheduled]
        window = group.spec.window
        width = group.spec.table_width(0, bs) if window else max(map(len, tables))
        table = _padded(tables, width)
        logical = positions // bs
        if window:
            logical %= width
        slots = table[row, logical].astype(np.int64) * bs + positions % bs
        if window:
            # Within one chunk the ring wraps: only the last width*bs tokens survive.
            slots[positions < (seq_lens - width * bs)[row]] = -1
        out.append(GroupArrays(table, slots, seq_lens.astype(np.int32)))
    # Positions are slots but after an eviction, whose kept tokens keep their positions.
    offsets = np.fromiter((s.position_offset for s in scheduled), dtype=np.int64, count=n)
    if offsets.any():
        positions = positions + offsets[row]
    score_from = None
    if any(s.score_from is not None for s in scheduled):
        froms = (NO_SCORES if s.score_from is None else s.score_from for s in scheduled)
        score_from = np.fromiter(froms, dtype=np.int32, count=n)
    cu, starts = cu.astype(np.int32), starts.astype(np.int32)
    return StepArrays(ids, positions, cu, starts, out, score_from)


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on ``device``: views of the arrays on the CPU; elsewhere one
    pinned buffer holding them all, copied in one transfer and sliced there (each back to its
    dtype: a 64-bit slot of the buffer per element)."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    flat = host.numpy()
    start = 0
    for a, k in zip(arrays, sizes):
        flat[start : start + k] = a.ravel()
        start += k
    on_device = host.to(device, non_blocking=True)
    tensors = []
    for a, part in zip(arrays, on_device.split(sizes)):
        dtype = torch.int32 if a.dtype == np.int32 else torch.int64
        tensors.append(part.view(a.shape).to(dtype))
    return tensors
