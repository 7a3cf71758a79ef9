"""Decode steps replayed from CUDA graphs: one graph per padded batch size.

A decode-only step is the same ~45 launches per layer every time; replaying them as one graph
removes the host's launch overhead. Inputs live in persistent device buffers (token ids,
positions, and per cache group the slots, block tables of fixed width and lengths), filled from
pinned host buffers before each replay. A batch is padded up to the next captured size: padded
rows write nowhere (slot -1) and attend one position of block 0. Sampling stays outside.

Capture needs a backend whose launches do not depend on the data (``capturable``) and a model
whose forward neither syncs with the host nor copies from it (``CausalLM.cuda_graphs``).
"""

from __future__ import annotations

import torch

from engine.worker.step_inputs import StepArrays
from kernels.backend import AttentionBackend, AttentionMetadata
from kernels.paged import ForwardContext
from models.interface import CausalLM
from models.kv_spec import KVCacheGroup

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: every step of up to ``max_num_seqs`` sequences pads to one
    (beyond the largest size, 256, steps run eagerly)."""
    largest = min(max_num_seqs, BATCH_SIZES[-1])
    return [b for b in BATCH_SIZES if b < largest] + [largest]


class _Buffers:
    """One cache group's step inputs: a pinned host copy and the device tensors graphs read."""

    def __init__(self, batch: int, width: int, device: torch.device):
        self.host = {
            "slots": torch.full((batch,), -1, dtype=torch.long, pin_memory=True),
            "tables": torch.zeros(batch, width, dtype=torch.int32, pin_memory=True),
            "seq_lens": torch.ones(batch, dtype=torch.int32, pin_memory=True),
        }
        self.device = {k: v.to(device) for k, v in self.host.items()}
        self.prefix = torch.zeros(batch, dtype=torch.int32, device=device)  # decodes: unused

    def upload(self) -> None:
        for name, host in self.host.items():
            self.device[name].copy_(host, non_blocking=True)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        groups: list[KVCacheGroup],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_to_group: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        recent_layers: int = 0,  # ``ForwardContext.recent_layers``
    ):
        self.model, self.backend, self.groups = model, backend, groups
        self.recent_layers = recent_layers
        self.kv_caches, self.layer_to_group = kv_caches, layer_to_group
        self.sizes = batch_sizes(max_num_seqs)
        batch = self.sizes[-1]
        self.widths = [g.spec.table_width(max_model_len, block_size) for g in groups]
        self.buffers = [_Buffers(batch, w, device) for w in self.widths]
        self.ids_host = torch.zeros(batch, dtype=torch.long, pin_memory=True)
        self.pos_host = torch.zeros(batch, dtype=torch.long, pin_memory=True)
        self.ids, self.pos = self.ids_host.to(device), self.pos_host.to(device)
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _context(self, batch: int) -> ForwardContext:
        metas = [
            AttentionMetadata(
                slot_mapping=buf.device["slots"][:batch],
                block_tables=buf.device["tables"][:batch],
                seq_lens=buf.device["seq_lens"][:batch],
                prefix_lens=buf.prefix[:batch],
                cu_seqlens_q=self.cu[: batch + 1],
                num_decodes=batch,
                window=group.spec.window,
            )
            for group, buf in zip(self.groups, self.buffers)
        ]
        return ForwardContext.planned(
            self.backend, metas, self.kv_caches, self.layer_to_group,
            recent_layers=self.recent_layers,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool (a smaller batch reuses the larger's memory)."""
        pool = None
        for batch in reversed(self.sizes):
            ctx = self._context(batch)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels outside the capture
                self.model(self.ids[:batch], self.pos[:batch], ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[batch] = self.model(self.ids[:batch], self.pos[:batch], ctx)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def fits(self, num_seqs: int, tables: list[list[list[int]]]) -> bool:
        """Whether a decode step of these sequences (tables per sequence per group) can replay."""
        if num_seqs > self.max_batch:
            return False
        return all(len(t[g]) <= w for t in tables for g, w in enumerate(self.widths))

    @torch.inference_mode()
    def run(self, step: StepArrays) -> torch.Tensor:
        """One decode step -> hidden states [n, hidden] (a view of the graph's output)."""
        n = len(step.input_ids)
        batch = next(b for b in self.sizes if b >= n)
        self.ids_host.numpy()[:n] = step.input_ids
        self.pos_host.numpy()[:n] = step.positions
        for arrays, buf in zip(step.groups, self.buffers):
            slots, lens, rows = (buf.host[k].numpy() for k in ("slots", "seq_lens", "tables"))
            width = arrays.block_tables.shape[1]
            rows[:n, :width] = arrays.block_tables
            slots[:n], lens[:n] = arrays.slot_mapping, arrays.seq_lens
            slots[n:batch], lens[n:batch] = -1, 1
            buf.upload()
        self.ids.copy_(self.ids_host, non_blocking=True)
        self.pos.copy_(self.pos_host, non_blocking=True)
        self.graphs[batch].replay()
        return self.hidden[batch][:n]
