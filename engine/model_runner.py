"""Builds a step's flat tensors from scheduler output, runs the model, samples."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kv_spec import KVCacheGroup, MLASpec
from engine.outputs import TokenLogprob
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from kernels.backend import AttentionBackend
from kernels.paged import AttentionMetadata, ForwardContext
from models.loader import load_model

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        dtype: str,
        device: torch.device,
        backend: AttentionBackend,
        seed: int,
        eos_token_ids: tuple[int, ...],
    ):
        self.device = device
        self.dtype = TORCH_DTYPES[dtype]
        self.backend = backend
        self.model = load_model(model_config, self.dtype, device)
        self.groups: list[KVCacheGroup] = self.model.kv_cache_groups(model_config, dtype)
        layer_to_group = [0] * model_config.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layer_ids:
                layer_to_group[layer] = gi
        self.layer_to_group = tuple(layer_to_group)
        self.sampler = Sampler(seed, eos_token_ids, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0

    def allocate_kv_cache(self, num_blocks: tuple[int, ...], block_size: int) -> None:
        self.block_size = block_size
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, n in zip(self.groups, num_blocks):
            for layer in g.layer_ids:
                caches[layer] = self._allocate(g.spec, n, block_size)
        self.kv_caches = [caches[i] for i in range(len(caches))]

    def _allocate(self, spec, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(dtype=self.dtype, device=self.device)
        if isinstance(spec, MLASpec):
            cache = torch.zeros(n, block_size, 1, spec.row_width, **kw)
            return cache, cache[..., : spec.kv_lora_rank]
        shape = (n, block_size, spec.num_kv_heads, spec.head_dim)
        return torch.zeros(shape, **kw), torch.zeros(shape, **kw)

    def _metadata(self, out: SchedulerOutput, cu: torch.Tensor) -> list[AttentionMetadata]:
        bs = self.block_size
        seq_lens = [s.start_pos + len(s.token_ids) for s in out.scheduled]
        prefix_lens = [s.start_pos for s in out.scheduled]
        metas = []
        for gi, group in enumerate(self.groups):
            window = group.spec.window
            tables = [s.block_tables[gi] for s in out.scheduled]
            width = group.spec.table_width(0, bs) if window else max(len(t) for t in tables)
            table_t = torch.zeros(len(tables), width, dtype=torch.int32)
            slots = []
            for i, (s, table) in enumerate(zip(out.scheduled, tables)):
                table_t[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
                pos = torch.arange(s.start_pos, seq_lens[i])
                logical = pos // bs
                if window:
                    logical = logical % width
                slot = table_t[i, logical].long() * bs + pos % bs
                if window:
                    # Within one chunk the ring wraps: only the last width*bs tokens survive.
                    slot[pos < seq_lens[i] - width * bs] = -1
                slots.append(slot)
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.cat(slots).to(self.device),
                    block_tables=table_t.to(self.device),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                    prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=self.device),
                    cu_seqlens_q=cu,
                    num_decodes=out.num_decodes,
                    window=window,
                )
            )
        return metas

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        self.sampler.forget(out.finished_ids)
        sched = out.scheduled
        lens = [len(s.token_ids) for s in sched]
        cu_list = [0]
        for n in lens:
            cu_list.append(cu_list[-1] + n)
        cu = torch.tensor(cu_list, dtype=torch.int32, device=self.device)
        input_ids = torch.tensor([t for s in sched for t in s.token_ids], device=self.device)
        positions = torch.cat(
            [torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in sched]
        )
        ctx = ForwardContext(
            self.backend, self._metadata(out, cu), self.kv_caches, self.layer_to_group
        )
        hidden = self.model(input_ids, positions.to(self.device), ctx)
        rows = [cu_list[i + 1] - 1 for i, s in enumerate(sched) if s.sample]
        if not rows:
            return {}
        chosen = [s for s in sched if s.sample]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        results = self.sampler.sample(
            logits,
            [s.request_id for s in chosen],
            [s.params for s in chosen],
            [s.prompt_token_ids for s in chosen],
            [s.output_token_ids for s in chosen],
        )
        return {s.request_id: r for s, r in zip(chosen, results)}
