"""Continuous batching with a token budget, chunked prefill, preemption and context policies.

Each step: running requests first (decodes and unfinished prefill chunks), then queued ones,
waiting or swapped, best ``(priority, arrival)`` first, while the token budget, ``max_num_seqs``
and free blocks allow. When a running request needs a block and none is free, the
``Preemption`` policy picks a victim among all running requests and recomputes it later or
swaps its blocks to the host pool. When a sequence fills ``max_model_len``, its context policy
decides: finish, or drop tokens (a shift), whose cache rotation the next step carries. Every
drop, a prompt's at admission too, is carried out here (``drop``), and every context-overflow
decision on a queued or running request is counted here (``overflow``). An importance policy
evicts instead (``evict``): the request's cache shrinks to the tokens the runner judges most
important, which keep their positions, so the cache's slots and the tokens' positions part
(``Request.slot``): the block manager counts slots, the model's rotary embedding positions.
Pure Python: the output is plain data for the model runner.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.core.config import SchedulerConfig
from engine.core.context_overflow import ContextPolicy, ContextState, Drop, Evict, Finish
from engine.core.kv_manager import BlockPairs, BlockTables, KVCacheManager
from engine.core.preemption import Preemption
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, queue_key
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import (
    FIRST_DRAFTS,
    LAG_TOKENS,
    DraftLength,
    SpeculativeConfig,
    ngram_propose,
)


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens computed this step
    start_pos: int  # cache slot of token_ids[0]; its position after an eviction (see below)
    block_tables: list[list[int]]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Speculation: token_ids ends with this many drafted tokens (a draft model's are filled in
    # before the forward pass); the rows of all of them and of the token before are sampled.
    num_drafts: int = 0
    # For a draft model: its cache holds positions before draft_start, and draft_context are
    # the tokens from there to start_pos, which it computes before drafting; with
    # draft_prefill it computes them and token_ids (a prompt chunk) without drafting.
    draft_start: int = 0
    draft_context: list[int] = field(default_factory=list)
    draft_prefill: bool = False
    # Importance eviction: positions are slots plus this (the tokens evicted so far), and the
    # rows from this slot on add the attention they pay to the keys' scores (None: no row).
    position_offset: int = 0
    score_from: int | None = None


@dataclass
class CacheShift:
    """A sequence's cached keys in ``blocks`` (per group) move ``delta`` positions, after the
    ``copies`` (per group: shared block, its private copy) are made."""

    request_id: str
    delta: int
    blocks: BlockTables
    copies: BlockPairs = field(default_factory=list)


@dataclass
class CacheEviction:
    """A sequence keeps ``keep`` of its ``cached`` tokens, chosen by ``policy`` (per KV head
    or once per layer), always its ``sinks`` first and ``window`` last ones; the runner reads
    them through the ``old`` tables and writes them, compacted, through the ``new`` ones."""

    request_id: str
    policy: str
    keep: int
    cached: int
    old: BlockTables
    new: BlockTables
    sinks: int
    window: int
    per_head: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # one-token (decode) requests first
    num_decodes: int
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step
    preempted_ids: list[str] = field(default_factory=list)
    # Cache moves, carried out in this order before the step's forward pass. A step swaps out
    # or in, never both, so a host block freed by a swap-in is not yet reused. Evictions come
    # first, in the order they were decided: the blocks they give up, which they still read,
    # are written only by the moves after them and by the forward pass.
    # Before them, the host tier's copies (``kv_tiers``): evicted prefix blocks written down
    # (their device blocks may be refilled by any move after), then hits copied up.
    # Before them, the disk tier's writes, reads and drops (``kv_tiers.DiskOp``), in order.
    disk_ops: list[tuple] = field(default_factory=list)
    spills: BlockPairs = field(default_factory=list)  # per group: (device, host)
    loads: BlockPairs = field(default_factory=list)  # per group: (host, device)
    evictions: list[CacheEviction] = field(default_factory=list)
    shifts: list[CacheShift] = field(default_factory=list)
    # Ring blocks a prefill chunk still reads but must not write over: copied to fresh ones.
    copies: BlockPairs = field(default_factory=list)  # per group: (block, its fresh copy)
    swap_out: BlockPairs = field(default_factory=list)  # per group: (device, host)
    swap_in: BlockPairs = field(default_factory=list)  # per group: (host, device)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def has_cache_ops(self) -> bool:
        return (
            bool(self.evictions or self.shifts)
            or bool(self.disk_ops)
            or any(self.spills)
            or any(self.loads)
            or any(self.copies)
            or any(self.swap_out)
            or any(self.swap_in)
        )


@dataclass
class SchedulerEvents:
    """Counts since the engine last drained them, for the metrics."""

    preemptions: Counter = field(default_factory=Counter)  # by mode
    context_overflows: Counter = field(default_factory=Counter)  # by policy
    swapped_blocks: Counter = field(default_factory=Counter)  # by direction
    prefix_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hits: int = 0  # of which found (in any tier)
    host_hits: int = 0  # of which found in the host tier
    disk_hits: int = 0  # of which found in the disk tier
    evictions: Counter = field(default_factory=Counter)  # by policy
    evicted_tokens: Counter = field(default_factory=Counter)  # by policy
    drafted: int = 0  # speculative tokens verified
    accepted_at: Counter = field(default_factory=Counter)  # accepted, by draft position


class _Step:
    """What one ``schedule`` call has decided so far."""

    def __init__(self, budget: int, num_groups: int):
        self.budget = budget
        self.scheduled: dict[str, tuple[Request, int]] = {}  # in scheduling order
        self.drafts: dict[str, list[int]] = {}  # n-gram drafts; a draft model's: []
        self.preempted: list[str] = []
        self.swap_out: BlockPairs = [[] for _ in range(num_groups)]
        self.swap_in: BlockPairs = [[] for _ in range(num_groups)]
        self.copies: BlockPairs = [[] for _ in range(num_groups)]
        self.loads: BlockPairs = [[] for _ in range(num_groups)]

    def allocated(self, copies: BlockPairs) -> None:
        for pairs, new in zip(self.copies, copies):
            pairs.extend(new)

    def add(self, req: Request, n: int) -> None:
        self.scheduled[req.request_id] = (req, n)
        self.budget -= n


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        default_context_policy: ContextPolicy,
        eos_token_ids: tuple[int, ...] = (),
        speculation: SpeculativeConfig | None = None,
    ):
        self.config = config
        self.speculation = speculation
        self.draft_length = DraftLength(speculation) if speculation else None
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.preemption = Preemption(config.preemption_mode)
        self.default_context_policy = default_context_policy  # for requests without their own
        self.waiting = RequestQueue()
        self.swapped = RequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.events = SchedulerEvents()
        self._finished_ids: list[str] = []
        self._shifts: list[CacheShift] = []
        self._evictions: list[CacheEviction] = []
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, req: Request, drop: Drop | None = None) -> None:
        """Queue ``req``; ``drop``: the prompt tokens its context policy drops at admission."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.block_tables = self.kv.new_tables()
        self.requests[req.request_id] = req
        if drop is not None:
            self.overflow(req, drop)  # before it is queued: the queue counts its tokens
        self.waiting.push(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req.block_tables)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.kv.free_host(req.host_tables)
            self.swapped.remove(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def live_requests(self) -> list[Request]:
        return list(self.requests.values())

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens the waiting requests have still to compute."""
        return self.waiting.num_tokens

    def _next_queued(self) -> Request:
        """The best of the waiting and swapped requests; waiting first among equals."""
        waiting, swapped = self.waiting.peek(), self.swapped.peek()
        if waiting is None or (swapped is not None and queue_key(swapped) < queue_key(waiting)):
            return swapped
        return waiting

    def drain_events(self) -> SchedulerEvents:
        events, self.events = self.events, SchedulerEvents()
        return events

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.tiers.end_step()  # the last step's copies have run
        step = _Step(self.config.max_num_batched_tokens, len(self.kv.groups))
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            n = self._chunk(req, step.budget)
            start = req.num_cached_slots
            while not self.kv.can_allocate(req.block_tables, start + n, start):
                victim, was_scheduled = self._preempt(step, self.running)
                if victim is req:
                    break
                i -= was_scheduled  # it stood before req in self.running
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; self.running[i] is now the next one
            step.allocated(self.kv.allocate(req.block_tables, start + n, start))
            step.add(req, n)
            i += 1
        if not step.preempted:  # else the running requests alone overfill the pool
            self._admit(step)
        if self.speculation is not None:
            self._speculate(step)

        items = sorted(step.scheduled.values(), key=lambda item: item[1] != 1)  # decodes first
        live = (RequestStatus.RUNNING, RequestStatus.SWAPPED)
        out = SchedulerOutput(
            scheduled=[self._to_plain(req, n, step.drafts.get(req.request_id)) for req, n in items],
            num_decodes=sum(1 for _, n in items if n == 1),
            finished_ids=self._finished_ids,
            preempted_ids=step.preempted,
            # A recomputed or finished sequence's blocks are no longer its own to rotate.
            evictions=[e for e in self._evictions if self._status(e.request_id) in live],
            shifts=[s for s in self._shifts if self._status(s.request_id) in live],
            spills=self.kv.tiers.take_spills(),
            disk_ops=self.kv.tiers.take_disk_ops(),
            loads=step.loads,
            copies=step.copies,
            swap_out=step.swap_out,
            swap_in=step.swap_in,
        )
        self._finished_ids = []
        self._shifts = []
        self._evictions = []
        return out

    def _admit(self, step: _Step) -> None:
        """Queued requests, best first, while they fit; a better one preempts worse ones.

        A step never both swaps in and swaps out: the runner copies out first, so a host block
        freed by a swap-in must not be refilled in the same step.
        """
        while (self.waiting or self.swapped) and step.budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self._next_queued()
            if req.request_id in step.preempted:
                break  # it just gave its blocks to a better request
            if req.status == RequestStatus.SWAPPED and step.preempted:
                break
            n = self._resume(req, step)
            if n:
                step.add(req, n)
                continue
            worse = [r for r in self.running if r.priority > req.priority]
            if req.status != RequestStatus.WAITING or not worse or any(step.swap_in):
                break
            self._preempt(step, worse)

    def _status(self, request_id: str) -> RequestStatus:
        req = self.requests.get(request_id)
        return req.status if req is not None else RequestStatus.FINISHED

    def _resume(self, req: Request, step: _Step) -> int:
        """Move a waiting or swapped request to running with room for its next tokens (a
        waiting one starting from the longest cached prefix); returns how many tokens it
        computes this step, 0 when it does not fit."""
        if req.status == RequestStatus.SWAPPED:
            n = self._chunk(req, step.budget)
            if not self.kv.can_swap_in(req.host_tables, req.num_cached_slots + n):
                return 0
            req.block_tables, copies = self.kv.swap_in(req.host_tables)
            for pairs, group_copies in zip(step.swap_in, copies):
                pairs.extend(group_copies)
            self.events.swapped_blocks["in"] += sum(len(c) for c in copies)
            self.swapped.remove(req)
        else:
            hit = self._take_prefix(req, step)
            n = min(self._chunk(req, step.budget), req.num_tokens - hit)
            if not self.kv.can_allocate(req.block_tables, hit + n, hit):
                self.kv.free(req.block_tables)
                return 0
            self.waiting.remove(req)
            req.num_computed_tokens = hit
            # A cached prefix holds the target's keys; a draft model computes its own again.
            req.num_draft_computed = 0
            if self.kv.prefix_caching:
                self.events.prefix_queries += req.num_tokens
                self.events.prefix_hits += hit
        start = req.num_cached_slots
        step.allocated(self.kv.allocate(req.block_tables, start + n, start))
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_tokens = req.num_computed_tokens
        self.running.append(req)
        return n

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of its known tokens ``req`` computes this step, within ``budget``: as many
        as it may, but that a sequence that evicted and is computed again after a preemption
        computes at most the context's slots at a time (evicting between)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        return min(n, max(1, self.config.max_model_len - 1 - req.num_cached_slots))

    def _take_prefix(self, req: Request, step: _Step) -> int:
        """Start a waiting request's tables with its longest cached prefix (at least one token
        is left to compute: its logits are needed), from the device pool and then the host
        tier; returns the prefix's tokens. A request asking for prompt logprobs computes its
        whole prompt: a cached prefix has no logits. Nor does a request whose policy scores its
        keys: a shared block's scores would be every sharer's."""
        if not self.kv.prefix_caching or req.params.prompt_logprobs is not None:
            return 0
        if self._scores_keys(req):
            return 0
        keys = self.kv.block_keys(req.token_ids, req.block_keys)
        found = self.kv.find_prefix(req.token_ids, keys, req.num_tokens - 1)
        hit = self.kv.take_prefix(req.block_tables, found)
        if hit or not found[0]:  # a device hit that could not be taken is not continued
            limit = (req.num_tokens - 1) // self.kv.block_size
            tiers = self.kv.tiers
            loaded, from_disk, copies = tiers.load_prefix(req.block_tables, req.token_ids, keys,
                                                          limit)  # fmt: skip
            for pairs, group_copies in zip(step.loads, copies):
                pairs.extend(group_copies)
            hit += loaded * self.kv.block_size
            self.events.host_hits += (loaded - from_disk) * self.kv.block_size
            self.events.disk_hits += from_disk * self.kv.block_size
        return hit

    def _speculate(self, step: _Step) -> None:
        """Draft slots for the decoding requests that speculate, as many as the measured
        costs and acceptance make worth it, where the pool and the token budget have room (a
        request never preempts another for drafts)."""
        config = self.speculation
        decoding = [
            req
            for req, n in step.scheduled.values()
            if n == 1 and req.num_computed_tokens == req.num_tokens - 1 and _speculates(req.params)
        ]
        room = [self._draft_room(req, alone=len(decoding) == 1) for req in decoding]
        prior = self.draft_length.prior
        acceptance = [prior if r.acceptance is None else r.acceptance for r in decoding]
        for req, k, r in zip(decoding, self.draft_length.choose(acceptance, room), room):
            if req.acceptance is None:  # unmeasured: a few drafts, to measure it
                k = max(k, min(FIRST_DRAFTS, r))
            k = min(k, step.budget)
            drafts = []
            if k and config.method == "ngram":
                drafts = ngram_propose(req.token_ids, k, config.ngram_min, config.ngram_max)
                k = len(drafts)
            start = req.num_cached_slots
            if not k or not self.kv.can_allocate(req.block_tables, start + 1 + k, start):
                continue
            step.allocated(self.kv.allocate(req.block_tables, start + 1 + k, start))
            step.budget -= k
            step.scheduled[req.request_id] = (req, 1 + k)
            step.drafts[req.request_id] = drafts

    def _draft_room(self, req: Request, alone: bool) -> int:
        """Most tokens ``req`` may draft: all of them and the target's own token stay within
        max_tokens and the context (where a context policy acts only after the last), and
        within a block, so that a ring's rejected writes never reach positions its window still
        reads. Choosing for itself, in a batch, none where a draft model fell behind on it:
        catching up costs a prefill of what it missed, which a single stream pays back over its
        answer but which holds up a whole batch."""
        config = self.speculation
        behind = req.num_computed_tokens - req.num_draft_computed > LAG_TOKENS
        if config.adaptive and config.method == "draft_model" and behind and not alone:
            return 0
        room = self.config.max_model_len - req.slot(req.num_tokens) - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return max(0, min(room, self.kv.block_size))

    def _to_plain(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        num_drafts = 0 if drafts is None else n - 1
        score_from = self.context_policy(req).score_from(len(req.prompt_token_ids))
        plain = ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids[start : start + n - num_drafts] + (drafts or []),
            start_pos=req.slot(start),
            block_tables=req.block_tables,
            sample=start + n - num_drafts == req.num_tokens,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            num_drafts=num_drafts,
            position_offset=req.num_evicted,
            score_from=None if score_from is None else max(0, req.slot(score_from)),
        )
        if self.speculation is None or self.speculation.method != "draft_model":
            return plain
        # A draft model computes the prompt with the target, so that its first drafts do not
        # wait for it (choosing for itself, where drafting pays at the size of the batch).
        adaptive = self.speculation.adaptive
        drafting = not adaptive or self.draft_length.pays(len(self.running))
        prefill = not num_drafts and n > 1 and drafting and _speculates(req.params)
        if num_drafts or prefill:
            plain.draft_start = req.slot(req.num_draft_computed)
            plain.draft_context = req.token_ids[req.num_draft_computed : start]
            plain.draft_prefill = prefill
        return plain

    def _preempt(self, step: _Step, candidates: list[Request]) -> tuple[Request, bool]:
        """Preempt one of ``candidates``: (the victim, whether it was scheduled this step)."""
        victim, mode = self.preemption.decide(
            candidates, lambda r: self.kv.can_swap_out(r.block_tables)
        )
        self.running.remove(victim)
        victim.num_registered_blocks = 0  # its blocks are about to change hands
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.events.preemptions[mode] += 1
        step.preempted.append(victim.request_id)
        was_scheduled = victim.request_id in step.scheduled
        if was_scheduled:
            step.budget += step.scheduled.pop(victim.request_id)[1]
        if mode == "swap":
            victim.host_tables, copies = self.kv.swap_out(victim.block_tables)
            for pairs, group_copies in zip(step.swap_out, copies):
                pairs.extend(group_copies)
            self.events.swapped_blocks["out"] += sum(len(c) for c in copies)
            victim.status = RequestStatus.SWAPPED
            self.swapped.push(victim, front=True)
        else:
            self.kv.free(victim.block_tables)
            victim.num_computed_tokens = victim.num_draft_computed = victim.num_evicted = 0
            victim.status = RequestStatus.WAITING
            self.waiting.push(victim, front=True)
        return victim, was_scheduled

    def update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens (a speculating request's accepted
        drafts and the token after them), finish what must stop, give back the blocks of
        rejected drafts.

        Returns the requests that received tokens this step, each with how many it kept (a
        stop among accepted drafts ends the run there).
        """
        got_tokens = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted during the step
            tokens = sampled[s.request_id] if s.sample else []
            accepted = max(0, len(tokens) - 1)
            decoding = req.num_computed_tokens >= len(req.prompt_token_ids)
            # The rows of rejected drafts hold nothing: the target's own token follows the
            # accepted ones.
            req.num_computed_tokens += len(s.token_ids) - s.num_drafts + accepted
            if s.num_drafts:
                self._count_drafts(req, s, accepted)
            elif s.draft_prefill:
                req.num_draft_computed = s.start_pos + len(s.token_ids)
            if self.kv.prefix_caching and self._registers(req):
                known = req.token_ids + tokens[:accepted]
                req.num_registered_blocks = self.kv.cache_blocks(
                    req.block_tables, known, req.block_keys, req.num_computed_tokens,
                    req.num_registered_blocks,
                )  # fmt: skip
            kept = 0
            for token in tokens:
                req.append_token(token)
                kept += 1
                self._check_stop(req, token)
                if req.status != RequestStatus.RUNNING:
                    break
            if kept:
                got_tokens.append((req, kept))
            if s.num_drafts and req.status == RequestStatus.RUNNING:
                self.kv.trim(req.block_tables, req.slot(req.num_tokens))
            if req.status == RequestStatus.RUNNING:
                self._over_budget(req, decoding)
        return got_tokens

    def _scores_keys(self, req: Request) -> bool:
        """Whether attention accumulates scores in ``req``'s blocks, which must then be its
        own: it shares no cached prefix and registers no blocks (registering may swap a block
        for an equal cached one, whose scores are not its own)."""
        return self.context_policy(req).score_from(len(req.prompt_token_ids)) is not None

    def _registers(self, req: Request) -> bool:
        """Whether ``req`` registers its blocks in the prefix cache: not once it has evicted
        (its blocks hold no run of tokens in order), nor while it scores its keys."""
        return not req.num_evicted and not self._scores_keys(req)

    def _over_budget(self, req: Request, decoding: bool) -> None:
        """After a step, a sequence with a KV budget evicts down to it; one computed again
        after a preemption evicts whenever the context's slots are full."""
        policy = self.context_policy(req)
        left = req.num_tokens - req.num_computed_tokens
        decision = policy.over_budget(req.num_cached_slots, decoding, left <= 1, self.kv.block_size)
        if decision is None and left > 1 and req.num_cached_slots >= self.config.max_model_len - 1:
            decision = policy.on_full(self._context_state(req))
        if isinstance(decision, Evict):
            try:
                self.evict(req, decision.keep)
            except MemoryError:
                pass  # the shared blocks it would replace: it tries again after its next step

    def _count_drafts(self, req: Request, s: ScheduledRequest, accepted: int) -> None:
        """A verified speculation: the request's acceptance rate, the metrics' counts, and
        what its draft model's cache now holds (what it computed, up to the first rejection)."""
        rate = self.draft_length.observe_acceptance(req.acceptance, s.num_drafts, accepted)
        req.acceptance = rate
        self.events.drafted += s.num_drafts
        for position in range(accepted):
            self.events.accepted_at[position] += 1
        if self.speculation.method == "draft_model":
            req.num_draft_computed = min(req.num_computed_tokens, s.start_pos + s.num_drafts)

    def observe_step(
        self, out: SchedulerOutput, forward_s: float, step_s: float, tokens: int
    ) -> None:
        """A decode step's cost (its forward pass took ``forward_s``, the whole step with
        drafting ``step_s``) and yield (``tokens``), for choosing later draft lengths; steps
        with prefill chunks say nothing about either."""
        if self.draft_length is None or not out.scheduled:
            return
        if all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in out.scheduled):
            self.draft_length.observe_step(out.num_tokens, forward_s)
            drafted = any(s.num_drafts for s in out.scheduled)
            self.draft_length.observe_yield(len(out.scheduled), drafted, tokens, step_s)

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens and not params.forced:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.finish(req, "stop")
            if token in params.stop_token_ids:
                return self.finish(req, "stop", token)
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return self.finish(req, "length")
        if req.slot(req.num_tokens) >= self.config.max_model_len:
            return self._context_full(req)
        return None

    def _context_full(self, req: Request) -> None:
        """The next token has no position left: the request's context policy decides."""
        self.overflow(req, self.context_policy(req).on_full(self._context_state(req)))

    def _context_state(self, req: Request) -> ContextState:
        return ContextState(
            prompt_len=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            limit=self.config.max_model_len,
            block_size=self.kv.block_size,
            discard_end=self.kv.discard_end(req.block_tables, req.num_cached_slots),
            dropped=req.num_dropped_tokens + req.num_evicted,
            max_dropped=self.config.max_overflow_tokens,
        )

    def context_policy(self, req: Request) -> ContextPolicy:
        return req.context_policy or self.default_context_policy

    def overflow(self, req: Request, decision: Drop | Evict | Finish) -> None:
        """Carry out what the request's context policy decided, and count it."""
        self.events.context_overflows[self.context_policy(req).name] += 1
        try:
            if isinstance(decision, Drop):
                return self.drop(req, decision)
            if isinstance(decision, Evict):
                return self.evict(req, decision.keep)
        except MemoryError:  # no room to copy the blocks it shares: it cannot go on
            pass
        self.finish(req, "length")

    def evict(self, req: Request, keep: int) -> None:
        """Shrink the request's cache to ``keep`` tokens, the runner choosing which by the
        request's importance policy (a ``CacheEviction``). A draft model's cache keeps the
        first and the most recent tokens: what it lacks of the recent ones it computes again.
        Raises MemoryError, changing nothing, when the cache has no room for fresh blocks."""
        cached = req.num_cached_slots
        if keep >= cached:
            return
        policy = self.context_policy(req)
        old = self.kv.evict(req.block_tables, keep)
        new = [list(t) for t in req.block_tables]
        self._evictions.append(
            CacheEviction(req.request_id, policy.name, keep, cached, old, new, policy.sinks,
                          policy.window, policy.per_head)
        )  # fmt: skip
        self.events.evictions[policy.name] += 1
        self.events.evicted_tokens[policy.name] += cached - keep
        req.num_evicted += cached - keep
        recent = keep - min(policy.sinks, keep)
        req.num_draft_computed = max(req.num_draft_computed, req.num_computed_tokens - recent)
        req.num_registered_blocks = 0

    def drop(self, req: Request, drop: Drop) -> None:
        """Remove ``drop.count`` tokens at ``drop.start`` from the request, and from its cache
        where they are cached (the runner then moves the keys after them: a ``CacheShift``).
        Raises MemoryError, changing nothing, when the cache has no room for the copies."""
        if drop.start < req.num_computed_tokens:
            blocks, copies = self.kv.drop(
                req.block_tables, req.num_computed_tokens, drop.start, drop.count
            )
            self._shifts.append(CacheShift(req.request_id, -drop.count, blocks, copies))
        req.drop_tokens(drop.start, drop.count)
        first = drop.start // self.kv.block_size
        del req.block_keys[first:]  # the blocks from the first dropped one hold other tokens
        req.num_registered_blocks = min(req.num_registered_blocks, first)


def _speculates(params: SamplingParams) -> bool:
    """Forced tokens are known already; a request may also turn speculation off."""
    return not params.forced and params.speculate
