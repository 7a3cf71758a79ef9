"""The synchronous engine: requests in, one step at a time, output deltas out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from engine.args import EngineArgs
from engine.capacity import format_capacity
from engine.core.config import GIB, CacheConfig, SchedulerConfig, split_memory
from engine.core.context_overflow import (
    IMPORTANCE_POLICIES,
    SCORED_POLICIES,
    ContextPolicy,
    ContextState,
    Drop,
    Reject,
    context_policy,
)
from engine.core.errors import QueueFullError, RequestError
from engine.core.kv_events import EventLog
from engine.core.kv_manager import KVCacheManager
from engine.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.core.preemption import Admission
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_events import ZmqPublisher
from engine.metrics import EngineMetrics
from engine.worker.disk_tier import DiskStore, disk_pool_sizes, fingerprint
from engine.worker.drafter import Drafter
from engine.worker.memory import MemoryProfile
from engine.worker.model_runner import ModelRunner
from engine.worker.structured import Grammars
from engine.worker.tp_workers import Workers
from models.config import ModelConfig
from models.fetch import resolve_model
from models.kv_spec import KVCacheGroup
from models.tensor_parallel import TPRank
from models.tensor_parallel import check as check_tensor_parallel
from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")
# What eviction by importance answers a cache of int4 keys.
_NO_EVICTION = (
    "eviction by importance (snapkv, h2o, knorm) moves cached tokens, which int4 keys, "
    "quantized per 32 tokens, cannot follow: choose shift, sink, truncate or stop"
)


@dataclass(frozen=True)
class Admitted:
    """A request the engine takes (``LLMEngine.admit``): its prompt, its params, the context
    policy that will decide for it, and the prompt tokens that policy drops (None: none).
    Made once on the caller's thread; ``add_requests`` carries it out on the engine's."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    policy: ContextPolicy
    drop: Drop | None = None

    def for_choice(self, params: SamplingParams) -> Admitted:
        """The same decision for another choice of the request, whose params differ from
        these in the seed alone (nothing admission reads)."""
        return replace(self, params=params)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        path = resolve_model(args.model)
        self.model_path = path.resolve()
        self.model_config = ModelConfig.from_dir(path)
        tp_size = args.tensor_parallel_size
        check_tensor_parallel(self.model_config, tp_size)
        # Random-weight test checkpoints may come without a tokenizer: token-id prompts only.
        has_tokenizer = (path / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_dir(path) if has_tokenizer else None
        self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        args.default_overflow().check_limit(self.max_model_len)  # before any worker starts
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        eos = tuple(dict.fromkeys(tokenizer_eos + self.model_config.eos_token_ids))
        vocab = self.model_config.vocab_size
        self.grammars = Grammars(path / "tokenizer.json", vocab, eos) if has_tokenizer else None
        self.max_grammar_compile_s = args.max_grammar_compile_s  # read at each admission
        runner_config = args.runner_config(self.model_config, eos)
        self.device = runner_config.torch_device
        # Ranks 1..N-1 load their shares while this one loads its own.
        self.workers = Workers(runner_config) if tp_size > 1 else None
        self.runner = ModelRunner(runner_config, TPRank(0, tp_size), self.grammars)
        dtype = f"{runner_config.dtype}, KV cache {runner_config.kv_dtype}"
        self.speculation = args.speculative_config()
        self.drafter = self._load_drafter(eos)
        self.cache_config = self._cache_config(self.runner.groups)
        self.runner.allocate_kv_cache(self.cache_config)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(self.cache_config)
        if self.workers is not None:
            self.workers.start(self.cache_config)
        eager = "--enforce-eager" if args.enforce_eager else self.runner.graphs_unavailable()
        if eager is None:
            start = time.perf_counter()
            self.runner.capture_decode_graphs(self.max_model_len, args.max_num_seqs)
            sizes = self.runner.graphs.sizes
            log.info("captured decode graphs for batch sizes %s in %.1f s", sizes,
                     time.perf_counter() - start)  # fmt: skip
        else:
            log.info("decode steps run eagerly: %s", eager)
        if args.context_overflow in IMPORTANCE_POLICIES and self.runner.channel_keys:
            raise ValueError(_NO_EVICTION)
        events = args.kv_events()
        self.kv_events = EventLog(self.cache_config.block_size) if events else None
        self.kv = KVCacheManager(self.cache_config, self.kv_events)
        # Opened last but for the scheduler: a start-up that fails leaves no socket bound.
        self.publisher = ZmqPublisher(events) if events else None
        sched_config = SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            self.max_model_len,
            args.preemption_mode,
            args.max_overflow_tokens,
        )
        self.default_overflow = args.default_overflow()
        self.scheduler = Scheduler(
            sched_config, self.kv, context_policy(self.default_overflow), eos, self.speculation
        )
        self.admission = Admission(args.max_queue_len, args.max_queued_tokens)
        self.metrics = EngineMetrics(speculation=self.speculation)
        self.metrics.describe_cache(
            self.cache_config,
            self.max_model_len,
            context_overflow=args.context_overflow,
            preemption_mode=args.preemption_mode,
            enable_prefix_caching=self.kv.prefix_caching,
            speculative_method=self.speculation.method if self.speculation else "off",
        )
        if self.cache_config.num_disk_blocks:
            self._open_disk_tier()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Prompt logprobs gathered chunk by chunk until the request's first output.
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self._queue_wait = 1.0  # recent time from arrival to scheduling, for Retry-After
        self._log_start(dtype)

    def _log_start(self, dtype: str) -> None:
        args = self.args
        log.info(
            "model %s (%s, %s on %s, %s attention), max_model_len %d; %d torch threads; "
            "CPU kernels: %s\n%s",
            self.model_config.name,
            self.model_config.architecture,
            dtype,
            self.device,
            self.runner.backend.name,
            self.max_model_len,
            torch.get_num_threads(),
            self.runner.cpu_kernels,
            format_capacity(self.cache_config, self.max_model_len),
        )
        swap = self.cache_config.num_host_blocks
        log.info(
            "context overflow %s; preemption by %s%s; queue %s",
            args.context_overflow,
            args.preemption_mode,
            f" to {swap} host blocks" if swap else "",
            f"up to {args.max_queue_len} requests" if args.max_queue_len else "unbounded",
        )
        spec = self.speculation
        if spec is not None:
            source = f" from {args.speculative_model}" if self.drafter is not None else ""
            length = "adaptive, up to" if spec.adaptive else "exactly"
            log.info("speculative decoding: %s%s, %s %d drafts a step", spec.method, source,
                     length, spec.most)  # fmt: skip

    def _load_drafter(self, eos: tuple[int, ...]) -> Drafter | None:
        """The draft model, for the draft_model method; checked against the target's."""
        if self.speculation is None or self.speculation.method != "draft_model":
            return None
        args = self.args
        config = ModelConfig.from_dir(resolve_model(args.speculative_model))
        drafter = Drafter(args.runner_config(config, eos), args.max_num_batched_tokens)
        drafter.check(self.runner.groups, self.model_config.vocab_size)
        return drafter

    def _cache_config(self, groups: list[KVCacheGroup]) -> CacheConfig:
        """Pools from --num-kv-blocks, or sized to the KV memory; a swap pool with swap."""
        args, max_len = self.args, self.max_model_len
        if args.num_kv_blocks is None:
            memory = self._kv_memory_bytes()
            if self.drafter is not None:  # a block holds the draft's keys too
                target = sum(g.bytes_per_token for g in groups) * args.block_size
                memory = memory * target // (target + self.drafter.bytes_per_block(args.block_size))
            blocks = split_memory(groups, memory, args.block_size, max_len)
        else:
            blocks = (args.num_kv_blocks,) * len(groups)
        host_bytes = args.kv_host_cache_gib * GIB
        if args.preemption_mode == "swap":
            host_bytes += args.swap_space_gib * GIB
        tier = args.kv_host_cache_gib > 0
        if tier and not args.enable_prefix_caching:
            raise ValueError("--kv-host-cache-gib keeps prefix blocks: it needs prefix caching")
        if tier and any(g.recent for g in groups):
            raise ValueError(
                "--kv-host-cache-gib does not go with recent rows (--kv-cache-recent-tokens, or "
                "int4 keys, which keep them) yet"
            )
        if tier and any(g.spec.window for g in groups):
            raise ValueError(
                "--kv-host-cache-gib: models with sliding-window layers (Gemma 3) are not "
                "supported yet"
            )
        host = split_memory(groups, int(host_bytes), args.block_size, max_len) if host_bytes else ()
        disk = ()
        if self._disk_tier_checked(tier):
            disk = disk_pool_sizes(groups, args.kv_disk_cache_gib, args.block_size, max_len)
        if args.kv_tier_write_through and not tier:
            raise ValueError("--kv-tier-write-through needs --kv-host-cache-gib")
        return CacheConfig(groups, args.block_size, blocks, host, args.enable_prefix_caching, tier,
                           disk, args.kv_tier_write_through)  # fmt: skip

    def _disk_tier_checked(self, host_tier: bool) -> bool:
        """Whether the disk tier is asked for; raises if its flags do not go together."""
        args = self.args
        if args.kv_disk_cache_dir is None:
            if args.kv_disk_cache_gib:
                raise ValueError("--kv-disk-cache-gib bounds --kv-disk-cache-dir: give both")
            return False
        if not args.kv_disk_cache_gib:
            raise ValueError("--kv-disk-cache-dir needs --kv-disk-cache-gib (its byte bound)")
        if not host_tier:
            raise ValueError(
                "--kv-disk-cache-dir needs --kv-host-cache-gib: blocks go down to disk and "
                "back up through host memory"
            )
        if args.tensor_parallel_size > 1:
            raise ValueError("--kv-disk-cache-dir: not supported with --tensor-parallel-size > 1")
        return True

    def _open_disk_tier(self) -> None:
        """The disk tier's store over the host pool, and the blocks an earlier run left in it."""
        args, config = self.args, self.cache_config
        runner = self.runner
        c = runner.config
        dtypes = f"{c.dtype}/{c.kv_dtype}/{c.quantization or 'file'}"
        identity = fingerprint(str(self.model_path), dtypes, config.block_size, list(config.groups))
        store = DiskStore(args.kv_disk_cache_dir, identity, list(config.groups),
                          runner.host_caches, runner.kv_caches)  # fmt: skip
        runner.disk = store
        entries, skipped = store.scan()
        loaded = self.kv.tiers.seed_disk(entries)
        self.metrics.disk_blocks.labels("corrupt").inc(skipped)
        log.info("disk KV tier %s: %d blocks found, %d files skipped", store.root, loaded, skipped)

    def _kv_memory_bytes(self) -> int:
        if self.args.kv_cache_memory_gib is not None:
            return int(self.args.kv_cache_memory_gib * GIB)
        if self.device.type != "cuda":
            return GIB
        args, device = self.args, self.device
        weights = torch.cuda.memory_allocated(device)
        if self.workers is None:
            activations = self.runner.profile_run(
                args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len, args.block_size
            )
        else:  # the dummy step's all-reduces would wait for ranks that are not stepping
            activations = 0
            log.warning("tensor parallel: activation memory not profiled, set --kv-cache-memory")
        free, total = torch.cuda.mem_get_info(device)
        other = total - free - torch.cuda.memory_reserved(device)
        profile = MemoryProfile(total, weights, activations, other, args.gpu_memory_utilization)
        log.info(profile.describe())
        return profile.check(args.max_num_batched_tokens)

    # -- requests -----------------------------------------------------------------------------

    def context_policy(self, params: SamplingParams) -> ContextPolicy:
        """A request's policy; an importance policy without a budget of its own takes the
        server's."""
        choice, default = params.overflow or self.default_overflow, self.default_overflow
        if choice.kv_budget is None and choice.policy in IMPORTANCE_POLICIES:
            choice = replace(choice, kv_budget=default.kv_budget)
        return context_policy(choice)

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> Admitted:
        """Decides once, before any work, whether the engine takes the request: raises
        RequestError (400) if not, else returns the decision ``add_requests`` queues as it is.
        Reads nothing the engine thread changes (the model, the settings, the pools' sizes), so
        the HTTP thread may call it while the engine thread steps."""
        self._check_request(prompt_token_ids, params)
        if params.overflow is not None:
            params.overflow.check_limit(self.max_model_len)
        policy = self.context_policy(params)
        if policy.name in SCORED_POLICIES and not self.runner.config.kv_scores:
            raise RequestError(
                f"overflow policy {policy.name!r} reads importance scores this server does not "
                "keep; start it with --kv-scores (or --context-overflow snapkv|h2o), or choose "
                "knorm.",
                param="overflow.policy",
                code="invalid_overflow",
            )
        if policy.name in IMPORTANCE_POLICIES and self.runner.channel_keys:
            raise RequestError(_NO_EVICTION, param="overflow.policy", code="invalid_overflow")
        decision = policy.admit(self._prompt_state(len(prompt_token_ids), params))
        if isinstance(decision, Reject):
            self.metrics.refused(decision.code, policy.name)
            param = "overflow" if decision.code == "invalid_overflow" else "messages"
            raise RequestError(decision.message, param=param, code=decision.code)
        drop = decision if isinstance(decision, Drop) else None
        if drop is not None and params.prompt_logprobs is not None:
            message = (
                f"prompt_logprobs needs the whole prompt, but the {policy.name} context policy "
                f"would drop {drop.count} of its tokens."
            )
            raise RequestError(message, param="prompt_logprobs")
        kept = len(prompt_token_ids) - (drop.count if drop else 0)
        limit = self.max_model_len
        wanted = kept + (params.max_tokens or limit)
        if not self.kv.can_ever_fit(min(limit, wanted)):
            self.metrics.refused("kv_capacity")
            raise RequestError(
                f"The KV cache cannot hold {min(limit, wanted)} tokens of one request; "
                "reduce the request or raise --num-kv-blocks / --kv-cache-memory.",
                param="max_tokens",
            )
        return Admitted(tuple(prompt_token_ids), params, policy, drop)

    def _check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises unless every token id the request names is in the vocabulary, and its
        grammar (if any) compiles."""
        if not prompt_token_ids:
            raise RequestError("The prompt is empty.", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"Token ids must be in [0, {vocab}).", param="prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            message = f"stop_token_ids must be in [0, {vocab}), got {list(params.stop_token_ids)}."
            raise RequestError(message, param="stop_token_ids")
        if any(t >= vocab for t in params.forced):
            raise RequestError(f"Forced token ids must be in [0, {vocab}).", param="forced")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}).", param="logit_bias")
        if params.structured is not None:
            if self.grammars is None:
                message = "Structured output needs the model's tokenizer, and it has none."
                raise RequestError(message, param=params.structured.param)
            # Raises for an invalid one, one slower to compile than the limit, or one that ends
            # before min_tokens; waits for a compile thread meanwhile, so the server calls
            # admit off its event loop.
            try:
                self.grammars.admit(params, self.max_grammar_compile_s)
            except RequestError as e:
                if e.code == "grammar_too_complex":  # a limit, like the others counted
                    self.metrics.refused(e.code)
                raise

    def _prompt_state(self, prompt_len: int, params: SamplingParams) -> ContextState:
        """A prompt against the context limit, for its policy's ``admit``."""
        return ContextState(
            prompt_len=prompt_len,
            max_tokens=params.max_tokens,
            limit=self.max_model_len,
            block_size=self.cache_config.block_size,
            discard_end=self.kv.discard_end_when_full(self.max_model_len),
            can_rotate=self.runner.key_rope is not None,
        )

    def check_admission(self, num_requests: int, num_tokens: int = 0) -> None:
        """Raises unless the queue takes ``num_requests`` more requests (of ``num_tokens``
        prompt tokens) now: 429, or 400 for a group larger than the whole queue. Reads only
        counters, so another thread may ask before it does any work for the requests."""
        limit = self.admission.max_queue_len
        if limit is not None and num_requests > limit:
            message = f"The request starts {num_requests} sequences; the queue holds {limit}."
            raise RequestError(message, param="n", code="too_many_sequences")
        waiting = len(self.scheduler.waiting)
        refused = self.admission.decide(
            waiting, self.scheduler.num_waiting_tokens, num_requests, num_tokens
        )
        if refused is not None:
            self.metrics.refused(refused)
            raise QueueFullError(
                f"The server is at capacity ({waiting} requests waiting); retry later.",
                retry_after=min(60.0, max(1.0, self._queue_wait)),
            )

    def add_requests(self, requests: list[tuple[str, Admitted, int]]) -> None:
        """Queues (request_id, admitted, priority) as one group: all of them, or none (raising
        why: the queue is full). The admission decisions are carried out, not made again."""
        self.check_admission(len(requests), sum(len(a.prompt_token_ids) for _, a, _ in requests))
        for rid, admitted, priority in requests:
            params = admitted.params
            prompt = list(admitted.prompt_token_ids)
            req = Request(rid, prompt, params, priority=priority, context_policy=admitted.policy)
            self.scheduler.add_request(req, admitted.drop)
            self._detokenizers[rid] = IncrementalDetokenizer(self.tokenizer, params)
            if params.prompt_logprobs is not None:
                self._prompt_logprobs[rid] = [None]
        self.record_gauges()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Admits and queues one request (raising why not)."""
        self.add_requests([(request_id, self.admit(prompt_token_ids, params), priority)])

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self._detokenizers.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._finished(req)
        self.record_gauges()
        return RequestOutput(
            request_id,
            req.prompt_token_ids,
            [CompletionOutput(0, finish_reason="abort")],
            finished=True,
        )

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled and not out.has_cache_ops:
            self.runner.sampler.forget(out.finished_ids)
            self._record_step()
            return []
        started = time.perf_counter()
        catch_up = self._draft(out) if self.drafter is not None else 0.0
        if self.workers is not None:
            self.workers.step(out)  # raises EngineDeadError when a rank has gone
        try:
            start = time.perf_counter()
            sampled, prompt_logprobs = self.runner.execute(out)
            forward_s = time.perf_counter() - start
        except Exception as e:
            log.exception("engine step failed; failing its %d requests", len(out.scheduled))
            reqs = [self.scheduler.requests.get(s.request_id) for s in out.scheduled]
            return self._fail([r for r in reqs if r is not None], _describe("the step", e))
        for rid, (first, records) in prompt_logprobs.items():
            gathered = self._prompt_logprobs.get(rid)
            # A request recomputed after preemption predicts its prompt again: once is enough.
            if gathered is not None and len(gathered) >= first:
                gathered += records[len(gathered) - first :]
        failed = {rid: e for rid, e in sampled.items() if isinstance(e, Exception)}
        outputs = []
        for rid, e in failed.items():
            why = e if isinstance(e, RequestError) else _describe("sampling", e)
            outputs += self._fail([self.scheduler.requests[rid]], why)
        got = self.scheduler.update(
            out, {rid: [t for t, _ in s] for rid, s in sampled.items() if rid not in failed}
        )
        step_s = time.perf_counter() - started - catch_up
        self.scheduler.observe_step(out, forward_s, step_s, sum(kept for _, kept in got))
        for req, kept in got:
            try:
                outputs.append(self._output(req, sampled[req.request_id][:kept]))
            except Exception as e:  # this request's post-processing alone
                log.exception("post-processing failed for request %s", req.request_id)
                outputs += self._fail([req], _describe("post-processing", e))
        self._record_step()
        return outputs

    def _draft(self, out) -> float:
        """The draft model fills the step's draft slots; if it fails, the step goes on without
        drafts (the draft's cache then holds what it held before). Returns the seconds it spent
        catching up rather than drafting."""
        known = [len(s.token_ids) for s in out.scheduled]
        try:
            steps, seconds, catch_up = self.drafter.propose(out)
        except Exception:
            log.exception("the draft model failed; this step verifies no drafts")
            for s, n in zip(out.scheduled, known):
                s.token_ids, s.num_drafts, s.draft_prefill = s.token_ids[:n], 0, False
            return 0.0
        self.scheduler.draft_length.observe_drafting(steps, seconds)
        return catch_up

    def record_gauges(self) -> None:
        """The running/waiting/swapped gauges and KV usage, as they are now."""
        sched, kv = self.scheduler, self.kv
        total = 1.0 - kv.num_free_blocks / kv.num_total_blocks
        self.metrics.gauges(
            len(sched.running), len(sched.waiting), len(sched.swapped), kv.usage(), total
        )
        if kv.host_tier:
            moved = kv.tiers.take_counts()
            self.metrics.host_tier(kv.num_cached_host_blocks, kv.num_total_host_blocks,
                                   moved["host"])  # fmt: skip
            if kv.tiers.disk_pools:
                self.metrics.disk_tier(kv.num_cached_disk_blocks, kv.num_total_disk_blocks,
                                       moved["disk"])  # fmt: skip

    def _record_step(self) -> None:
        self.record_gauges()
        self.metrics.events(self.scheduler.drain_events())
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """What the prefix cache did since the last call, to the KV events' subscribers."""
        if self.publisher is not None:
            self.publisher.publish(self.kv_events.take())

    def _finished(self, req: Request) -> None:
        now = time.monotonic()
        self.metrics.finished(req, now)
        if req.first_scheduled_time is not None:
            wait = req.first_scheduled_time - req.arrival_time
            self._queue_wait = 0.8 * self._queue_wait + 0.2 * wait

    def _output(self, req: Request, samples: list) -> RequestOutput:
        """The output of the tokens ``req`` got this step, ended at a stop string among them."""
        det = self._detokenizers[req.request_id]
        tokens, logprobs = [], []
        stop = None
        for token, logprob in samples:
            tokens.append(token)
            logprobs.append(logprob)
            stop = det.add([token])
            if stop is not None:
                self.scheduler.finish(req, "stop", stop)
                break
        self.metrics.tokens(req, time.monotonic(), len(tokens))
        if stop is None and req.finished:
            det.flush()
        if req.finished:
            del self._detokenizers[req.request_id]
            self._finished(req)
        completion = CompletionOutput(
            0,
            det.take(req.finished),
            tokens,
            logprobs if logprobs[0] is not None else None,
            req.finish_reason,
            req.stop_reason,
        )
        return RequestOutput(
            req.request_id, req.prompt_token_ids, [completion], req.finished,
            req.num_cached_tokens, self._prompt_logprobs.pop(req.request_id, None),
        )  # fmt: skip

    def _fail(self, reqs: list[Request], error: str | RequestError) -> list[RequestOutput]:
        """Ends ``reqs`` with finish_reason "error" and the message ``error``, or the request's
        own fault ``error`` (a constraint it turned out not to meet: the server answers 400);
        each gets its final output even if it had just finished."""
        fault = error if isinstance(error, RequestError) else None
        message = error.message if fault is not None else error
        outs = []
        for req in reqs:
            if not req.finished:
                self.scheduler.finish(req, "error")
            if self._detokenizers.pop(req.request_id, None) is not None:
                self._finished(req)
            self._prompt_logprobs.pop(req.request_id, None)
            out = CompletionOutput(0, finish_reason="error", error=message, fault=fault)
            outs.append(RequestOutput(req.request_id, req.prompt_token_ids, [out], True))
        return outs

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "kv_free_blocks": self.kv.num_free_blocks,
            "kv_total_blocks": self.kv.num_total_blocks,
            "swap_free_blocks": self.kv.num_free_host_blocks,
            "swap_total_blocks": self.kv.num_total_host_blocks,
            "kv_usage": self.kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_caching": self.kv.prefix_caching,
            "prefix_cached_blocks": self.kv.num_cached_blocks,
        }

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were cached."""
        n = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return n

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks, if any, and the KV events' publisher."""
        if self.workers is not None:
            self.workers.stop()
        if self.publisher is not None:
            self.publisher.close()


def _describe(stage: str, error: BaseException) -> str:
    return f"{stage} failed for this request: {type(error).__name__}: {error}"
