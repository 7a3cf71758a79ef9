"""A step's flat inputs from numpy equal a plain per-sequence construction of them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledRequest
from engine.worker.step_inputs import step_arrays, to_device
from models.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

BS = 4
GROUPS = [
    KVCacheGroup(FullAttentionSpec(2, 8, "float32"), (0, 2)),
    KVCacheGroup(SlidingWindowSpec(2, 8, "float32", window_size=10), (1,)),
]


def naive(scheduled, groups, bs):
    """Sequence by sequence, token by token."""
    ids, positions, cu, prefix, per_group = [], [], [0], [], []
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.start_pos, s.start_pos + len(s.token_ids))
        cu.append(cu[-1] + len(s.token_ids))
        prefix.append(s.start_pos)
    for gi, group in enumerate(groups):
        window = group.spec.window
        tables = [s.block_tables[gi] for s in scheduled]
        width = group.spec.table_width(0, bs) if window else max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        slots = []
        for s, table in zip(scheduled, padded):
            end = s.start_pos + len(s.token_ids)
            for pos in range(s.start_pos, end):
                logical = pos // bs % width if window else pos // bs
                dropped = window and pos < end - width * bs  # overwritten later in the chunk
                slots.append(-1 if dropped else table[logical] * bs + pos % bs)
        lens = [s.start_pos + len(s.token_ids) for s in scheduled]
        per_group.append((padded, slots, lens))
    return ids, positions, cu, prefix, per_group


def random_step(rng: random.Random, n: int) -> list[ScheduledRequest]:
    scheduled, next_block = [], [0, 0]
    for i in range(n):
        start = rng.randrange(0, 40)
        count = 1 if i < n // 2 else rng.randrange(1, 30)  # decodes, then prefill chunks
        end = start + count
        tables = []
        for gi, group in enumerate(GROUPS):
            k = group.spec.num_blocks(end, BS)
            tables.append(list(range(next_block[gi], next_block[gi] + k)))
            next_block[gi] += k
        tokens = [rng.randrange(1000) for _ in range(count)]
        scheduled.append(
            ScheduledRequest(str(i), tokens, start, tables, True, SamplingParams(), [], [])
        )
    return scheduled


@pytest.mark.parametrize("seed", range(20))
def test_step_arrays_equal_the_sequence_by_sequence_construction(seed):
    rng = random.Random(seed)
    scheduled = random_step(rng, rng.randrange(1, 12))
    step = step_arrays(scheduled, GROUPS, BS)
    ids, positions, cu, prefix, per_group = naive(scheduled, GROUPS, BS)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == positions
    assert step.cu_seqlens_q.tolist() == cu and step.prefix_lens.tolist() == prefix
    assert step.sample_rows.tolist() == [c - 1 for c in cu[1:]]
    for g, (tables, slots, lens) in zip(step.groups, per_group):
        assert g.block_tables.tolist() == tables and g.block_tables.dtype == np.int32
        assert g.slot_mapping.tolist() == slots and g.slot_mapping.dtype == np.int64
        assert g.seq_lens.tolist() == lens


def test_a_chunk_longer_than_the_ring_writes_only_its_last_window():
    # Ring of ceil(10 / 4) + 1 = 4 blocks = 16 slots; a 20-token chunk from position 0.
    s = ScheduledRequest("a", list(range(20)), 0, [[0, 1, 2, 3, 4], [7, 8, 9, 6]], True,
                         SamplingParams(), [], [])  # fmt: skip
    slots = step_arrays([s], GROUPS, BS).groups[1].slot_mapping.tolist()
    assert slots[:4] == [-1] * 4
    # Positions 4..19 land once each on the ring's 16 slots.
    assert sorted(slots[4:]) == sorted(b * BS + o for b in (7, 8, 9, 6) for o in range(4))


def test_to_device_keeps_values_and_dtypes():
    arrays = [np.arange(5, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)]
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        a, b = to_device(arrays, torch.device(device))
        assert a.dtype == torch.int64 and b.dtype == torch.int32 and b.shape == (2, 3)
        assert a.cpu().tolist() == list(range(5)) and b.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
