"""Builds a step's flat tensors from scheduler output, runs the model, samples."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.core.config import CacheConfig
from engine.core.outputs import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import CacheShift, ScheduledRequest, SchedulerOutput
from engine.worker.config import RunnerConfig
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.disk_tier import DiskStore
from engine.worker.eviction import evict
from engine.worker.memory import dummy_lengths
from engine.worker.sampler import Sampler, logprobs_of
from engine.worker.step_inputs import step_arrays, to_device
from engine.worker.structured import Grammars
from kernels import cpu
from kernels.backend import AttentionBackend, AttentionMetadata, get_backend
from kernels.kv_quant import KV_DTYPES, check_prefix
from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout
from models.interface import CausalLM
from models.kv_spec import (
    KVCacheGroup,
    MLASpec,
    channel_keys,
    keys_quantized,
    kv_pair,
    row_bytes,
)
from models.layers import use_backend
from models.loader import load_model
from models.tensor_parallel import NO_TP, TPRank, shard_config

PROMPT_LOGITS_ROWS = 256

# Per sampled request: its new tokens, each with its logprob record or None (one token, or a
# speculating request's accepted drafts and one more), or the exception its sampling raised.
Sampled = dict[str, "list[tuple[int, TokenLogprob | None]] | Exception"]
PromptLogprobs = dict[str, tuple[int, list[TokenLogprob]]]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_kernels_off(config: RunnerConfig, tp: TPRank = NO_TP) -> str | None:
    """Why kernels.cpu does not run the model's layers (its linear layers and whole decoder
    layers) here, or None when it may: the one place that decides it. Its fused layers would
    skip a tensor-parallel model's all-reduces; the attention kernels serve either way. Its
    activations are float32 whatever the dtype, which narrows the matrices only
    (``CpuBackend``)."""
    if not config.cpu_kernels:
        return "off"
    if tp.size > 1:
        return "off (tensor parallel)"
    if config.torch_device.type != "cpu":
        return f"not on CPU ({config.device})"
    why = cpu.load()
    return None if why is None else f"unavailable, {why}"


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPRank = NO_TP, grammars: Grammars | None = None):
        """``tp``: this rank's share of a tensor-parallel model (its heads, its KV cache)."""
        self.config = config
        self.device = config.torch_device
        dtype = TORCH_DTYPES[config.dtype]
        # Decided here once; the backend and the start-up log both take this answer.
        not_model_kernels = model_kernels_off(config, tp)
        self.backend: AttentionBackend = get_backend(
            config.attention_backend, self.device, not_model_kernels is None,
            config.repack_weights, dtype,
        )  # fmt: skip
        self.dtype = self.backend.load_dtype(dtype)
        self.tp = tp
        model_config = shard_config(config.model_config, tp)
        self.model: CausalLM = load_model(
            model_config, self.dtype, self.device, tp, config.quantization
        )
        use_backend(self.model, self.backend)
        swapped = self.backend.prepare(self.model)
        self.cpu_kernels = not_model_kernels or self._cpu_kernels(swapped)
        self.groups: list[KVCacheGroup] = [
            replace(g, scored=config.kv_scores and not g.spec.window)
            for g in config.kv_cache_groups(type(self.model), model_config)
        ]
        if config.kv_scores and any(g.recent for g in self.groups):
            raise ValueError(
                "importance scores (--kv-scores, eviction by importance) do not go with recent "
                "rows (--kv-cache-recent-tokens, or int4 keys, which keep them)"
            )
        # int4 keys are quantized per 32 tokens: eviction's compaction would move rows out of
        # their groups (``engine.llm_engine`` refuses it).
        self.channel_keys = any(channel_keys(g.spec) for g in self.groups)
        if self.backend.name == "triton" and self.channel_keys:
            raise ValueError(
                "the triton backend does not read int4 keys (per channel) yet: use "
                "--kv-cache-dtype int8/int4"
            )
        # Groups of recent tokens (``models.kv_spec.with_recent``) hold layers numbered past the
        # model's: a layer with one has its cache there too, at its id plus the layer count.
        size = max(layer for g in self.groups for layer in g.layer_ids) + 1
        layer_to_group = [-1] * size
        for gi, g in enumerate(self.groups):
            for layer in g.layer_ids:
                layer_to_group[layer] = gi
        self.layer_to_group = tuple(layer_to_group)
        self.recent_layers = model_config.num_layers if size > model_config.num_layers else 0
        self.sampler = Sampler(config.seed, config.eos_token_ids, self.device, grammars)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the swap pool
        # Per layer, importance scores beside the cache (``KVCacheGroup.scored``), or None.
        self.scores: list[torch.Tensor | None] | None = None
        self.host_scores: list[torch.Tensor | None] | None = None
        self.disk: DiskStore | None = None  # the disk tier, over the host pool
        self.cache_config: CacheConfig | None = None
        quantized = any(keys_quantized(g.spec.dtype) for g in self.groups)
        if quantized and hasattr(self.model, "center_cached_keys"):
            self.model.center_cached_keys()  # a quantized row's scale then spans less
        # How each layer's cached keys were rotated; None: the model cannot shift its cache.
        rope = [self.model.cached_key_rope(i % model_config.num_layers) for i in range(size)]
        self.key_rope: list[RopeLayout] | None = None if None in rope else rope
        self.graphs: DecodeGraphs | None = None

    def _cpu_kernels(self, swapped: int) -> str:
        """For the start-up log, where ``model_kernels_off`` lets kernels.cpu run the model:
        whether it does (``swapped`` linear layers by ``prepare``)."""
        if not swapped:
            return f"off (the {self.backend.name} attention backend)"
        return f"on ({swapped} linear layers)"

    def graphs_unavailable(self) -> str | None:
        """Why decode steps cannot run from CUDA graphs here, or None when they can."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if self.tp.size > 1:
            return "tensor parallel"
        if not self.backend.capturable:
            return f"the {self.backend.name} attention backend is not capturable"
        if not self.model.cuda_graphs:
            return f"{type(self.model).__name__} is not capturable"
        return None

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.groups, self.kv_caches, self.layer_to_group,
            self.cache_config.block_size, max_model_len, max_num_seqs, self.device,
            self.recent_layers,
        )  # fmt: skip
        self.graphs.capture()

    def profile_run(
        self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
    ) -> int:
        """Runs the largest step the scheduler can make (prompts of ``dummy_lengths``, every
        one sampled, the first with logprobs and prompt logprobs) on a pool of its own, freed
        after. Returns the bytes torch allocated at the step's peak beyond what it held before
        the step (on CUDA; 0 elsewhere, where nothing measures it)."""
        lengths = dummy_lengths(max_num_batched_tokens, max_num_seqs, max_model_len)
        need = [[g.spec.num_blocks(n, block_size) for n in lengths] for g in self.groups]
        self.allocate_kv_cache(CacheConfig(self.groups, block_size, tuple(map(sum, need))))
        first = [0] * len(self.groups)
        scheduled = []
        for i, n in enumerate(lengths):
            tables = []
            for gi, counts in enumerate(need):
                tables.append(list(range(first[gi], first[gi] + counts[i])))
                first[gi] += counts[i]
            logprobs = dict(logprobs=1, prompt_logprobs=1) if i == 0 else {}
            params = SamplingParams(max_tokens=1, temperature=0.0, **logprobs)
            prompt = [0] * n
            scheduled.append(ScheduledRequest(f"profile-{i}", prompt, 0, tables, True, params,
                                              prompt, []))  # fmt: skip
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.execute(SchedulerOutput(scheduled, num_decodes=0))
        peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else 0
        self.kv_caches, self.cache_config, self.scores = [], None, None
        if cuda:
            torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, config: CacheConfig) -> None:
        """The device pools, and the host swap pool (pinned when the device is a GPU)."""
        self.cache_config = config
        self.kv_caches = self._allocate_pools(config.num_blocks)
        self.scores = self._score_planes(config.num_blocks, self.device)
        if config.num_host_blocks:
            pin = self.device.type == "cuda"
            self.host_caches = self._allocate_pools(config.num_host_blocks, "cpu", pin)
            self.host_scores = self._score_planes(config.num_host_blocks, "cpu", pin)

    def _score_planes(self, num_blocks: tuple[int, ...], device, pin: bool = False):
        """A float32 score per slot and KV head for each layer of a scored group."""
        if not any(g.scored for g in self.groups):
            return None
        planes: list[torch.Tensor | None] = [None] * len(self.layer_to_group)
        for g, n in zip(self.groups, num_blocks):
            if g.scored:
                shape = (n, self.cache_config.block_size, g.score_heads)
                for layer in g.layer_ids:
                    planes[layer] = torch.zeros(shape, device=device, pin_memory=pin)
        return planes

    def _allocate_pools(self, num_blocks: tuple[int, ...], device=None, pin: bool = False):
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, n in zip(self.groups, num_blocks):
            for layer in g.layer_ids:
                caches[layer] = self._allocate(g.spec, n, device, pin)
        return [caches.get(i) for i in range(len(self.layer_to_group))]

    def _allocate(
        self, spec, n: int, device=None, pin: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = self.cache_config.block_size
        # The host pool is only touched by swaps: empty() leaves its pages unmapped until then.
        new = torch.zeros if device is None else torch.empty

        def cache(dtype: str, dim: int, heads: int, keys: bool = False) -> torch.Tensor:
            torch_dtype = KV_DTYPES[dtype]
            row = row_bytes(dtype, dim, keys) // torch_dtype.itemsize
            kw = dict(dtype=torch_dtype, device=device or self.device, pin_memory=pin)
            return new((n, block_size, heads, row), **kw)

        if isinstance(spec, MLASpec):
            check_prefix(KV_DTYPES[spec.dtype], spec.row_width, spec.kv_lora_rank)
            rows = cache(spec.dtype, spec.row_width, 1)
            # A row's prefix is a row of its first values in every format (kernels.kv_quant).
            return rows, rows[..., : row_bytes(spec.dtype, spec.kv_lora_rank) // rows.itemsize]
        key, value = kv_pair(spec.dtype)
        return cache(key, spec.head_dim, spec.num_kv_heads, keys=True), cache(
            value, spec.head_dim, spec.num_kv_heads
        )

    @torch.inference_mode()
    def apply_cache_ops(self, out: SchedulerOutput, draft: bool = False) -> None:
        """The host tier's spills and loads (the target's cache only: a draft model computes a
        cached prefix again), evictions, shifts (copy-on-write copies first), ring copies,
        then swap-outs, then swap-ins: before any of the step's cache writes (``draft``: a
        draft model's cache)."""
        device = (self.kv_caches, self.scores)
        host = (self.host_caches, self.host_scores)
        if not draft and out.disk_ops:
            self.disk.apply(out.disk_ops)  # first: a write reads a host block a spill refills
        if not draft:
            for ops, src, dst in ((out.spills, device, host), (out.loads, host, device)):
                for group, pairs in zip(self.groups, ops):
                    copy_blocks(self.backend, group, pairs, src, dst)
        for eviction in out.evictions:
            evict(eviction, self.groups, self.kv_caches, self.scores, draft)
        for shift in out.shifts:
            for group, pairs in zip(self.groups, shift.copies):
                copy_blocks(self.backend, group, pairs, device, device)
            rotate_shifted_keys(self.backend, self.kv_caches, self.groups, self.key_rope, shift)
        for ops, src, dst in (
            (out.copies, device, device), (out.swap_out, device, host), (out.swap_in, host, device)
        ):  # fmt: skip
            for group, pairs in zip(self.groups, ops):
                copy_blocks(self.backend, group, pairs, src, dst)

    def _forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """The step run eagerly: hidden states of all new tokens, and the rows to sample."""
        bs = self.cache_config.block_size
        step = step_arrays(out.scheduled, self.groups, bs)
        flat = [step.input_ids, step.positions, step.cu_seqlens_q, step.prefix_lens]
        for g in step.groups:
            flat += [g.block_tables, g.slot_mapping, g.seq_lens]
        scoring = step.score_from is not None and self.scores is not None
        if scoring:
            flat.append(step.score_from)
        ids, positions, cu, prefix_lens, *per_group = to_device(flat, self.device)
        score_from = per_group.pop() if scoring else None
        metas = [
            AttentionMetadata(
                slot_mapping=slots,
                block_tables=tables,
                seq_lens=lens,
                prefix_lens=prefix_lens,
                cu_seqlens_q=cu,
                num_decodes=out.num_decodes,
                window=group.spec.window,
                score_from=score_from if group.scored else None,
            )
            for group, tables, slots, lens in zip(
                self.groups, per_group[0::3], per_group[1::3], per_group[2::3]
            )
        ]
        ctx = ForwardContext.planned(
            self.backend, metas, self.kv_caches, self.layer_to_group, self.scores,
            self.recent_layers,
        )  # fmt: skip
        hidden = self.model(ids, positions, ctx)
        # A sampled sequence's last row, and before it one per draft it verifies.
        last = step.sample_rows.tolist()
        rows = [r for s, end in zip(out.scheduled, last) if s.sample
                for r in range(end - s.num_drafts, end + 1)]  # fmt: skip
        return hidden, rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> tuple[Sampled, PromptLogprobs]:
        """The step: each sampling request's new tokens (``Sampled``) or the exception its
        sampling raised; and for requests asking for prompt logprobs, (position of the
        first prompt token this step predicts, a record per predicted prompt token).
        ``sample`` False (a tensor-parallel rank other than 0): the cache and forward only."""
        self.sampler.forget(out.finished_ids)
        if out.has_cache_ops:
            self.apply_cache_ops(out)
        sched = out.scheduled
        if not sched:
            return {}, {}
        if not sample:
            self._forward(out)
            return {}, {}
        chosen = [s for s in sched if s.sample]
        drafts = [s.token_ids[len(s.token_ids) - s.num_drafts :] for s in chosen]
        request_ids, params = [s.request_id for s in chosen], [s.params for s in chosen]
        # Constrained requests' token masks are filled while the forward pass runs.
        masks = self.sampler.start_masks(request_ids, params, drafts)
        tables = [s.block_tables for s in sched]
        scoring = any(s.score_from is not None for s in sched)
        if (
            self.graphs and not scoring and out.num_decodes == len(sched)
            and self.graphs.fits(len(sched), tables)
        ):  # fmt: skip
            hidden = self.graphs.run(step_arrays(sched, self.groups, self.cache_config.block_size))
            rows = [i for i, s in enumerate(sched) if s.sample]
        else:
            hidden, rows = self._forward(out)
        prompt_logprobs = self._prompt_logprobs(hidden, sched)
        if not rows:
            return {}, prompt_logprobs
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        results = self.sampler.verify(
            logits,
            request_ids,
            params,
            [s.prompt_token_ids for s in chosen],
            [s.output_token_ids for s in chosen],
            drafts,
            masks,
        )
        return dict(zip(request_ids, results)), prompt_logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor, sched: list) -> PromptLogprobs:
        """Logprobs of the prompt tokens that this step's rows predict (row p predicts
        token p + 1), for the requests that ask for them; raw model logprobs."""
        out = {}
        offset = 0
        for s in sched:
            n, k, prompt = len(s.token_ids), s.params.prompt_logprobs, s.prompt_token_ids
            m = min(n, len(prompt) - 1 - s.start_pos)
            if k is not None and m > 0:
                first = s.start_pos + 1
                records = []
                # Logits of a long chunk are big (rows x vocabulary): a slice at a time.
                for a in range(0, m, PROMPT_LOGITS_ROWS):
                    b = min(m, a + PROMPT_LOGITS_ROWS)
                    logits = self.model.compute_logits(hidden[offset + a : offset + b])
                    records += logprobs_of(logits, prompt[first + a : first + b], k)
                out[s.request_id] = (first, records)
            offset += n
        return out


# (k, v) per layer (None past the model's layers where no group holds a layer's recent tokens);
# v may be a view of k
Caches = list[tuple[torch.Tensor, torch.Tensor] | None]


def rotate_shifted_keys(
    backend: AttentionBackend,
    kv_caches: Caches,
    groups: list[KVCacheGroup],
    key_rope: list[RopeLayout],
    shift: CacheShift,
) -> None:
    """Re-rotate the keys a context shift moved, each layer by its own rope layout."""
    for group, blocks in zip(groups, shift.blocks):
        if not blocks:
            continue
        idx = torch.tensor(blocks, dtype=torch.long, device=kv_caches[0][0].device)
        for layer in group.layer_ids:
            backend.rotate_keys(kv_caches[layer][0], idx, shift.delta, key_rope[layer])


Scores = list[torch.Tensor | None] | None  # importance scores per layer (``ModelRunner.scores``)


def copy_blocks(
    backend: AttentionBackend,
    group: KVCacheGroup,
    pairs: list[tuple[int, int]],
    src: tuple[Caches, Scores],
    dst: tuple[Caches, Scores],
) -> None:
    """Copy whole blocks (src id, dst id) of every layer of ``group``: K, V and the scores."""
    if not pairs:
        return
    src_idx = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst_idx = torch.tensor([b for _, b in pairs], dtype=torch.long)
    (src_caches, src_scores), (dst_caches, dst_scores) = src, dst
    for layer in group.layer_ids:
        s_kv, d_kv = src_caches[layer], dst_caches[layer]
        shared = s_kv[1].data_ptr() == s_kv[0].data_ptr()  # MLA: V is the latent part of K
        pairs_of_layer = [(s_kv[0], d_kv[0])] if shared else list(zip(s_kv, d_kv))
        if group.scored:
            pairs_of_layer.append((src_scores[layer], dst_scores[layer]))
        for s, d in pairs_of_layer:
            backend.copy_blocks(s, d, src_idx, dst_idx)
