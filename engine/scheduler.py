"""Continuous batching with a token budget, chunked prefill and recompute preemption.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting
requests while the token budget, ``max_num_seqs`` and free blocks allow. When a running
request needs a block and none is free, the lowest-priority latest-arrived running request
is preempted: its blocks go back and it re-enters the queue at the front, to be recomputed.
Pure Python: the output is plain data for the model runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_tables: list[list[int]]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # one-token (decode) requests first
    num_decodes: int
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...] = ()
    ):
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.block_tables = self.kv.new_tables()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req.block_tables)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def live_requests(self) -> list[Request]:
        return list(self.requests.values())

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.can_allocate(req.block_tables, req.num_computed_tokens + n):
                victim = max(self.running[i:], key=lambda r: (r.priority, r.arrival_time))
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; self.running[i] is now the next one
            self.kv.allocate(req.block_tables, req.num_computed_tokens + n)
            scheduled.append((req, n))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_allocate(req.block_tables, req.num_computed_tokens + n):
                break
            self.kv.allocate(req.block_tables, req.num_computed_tokens + n)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        scheduled.sort(key=lambda item: item[1] != 1)  # stable: decodes first
        out = SchedulerOutput(
            scheduled=[self._to_plain(req, n) for req, n in scheduled],
            num_decodes=sum(1 for _, n in scheduled if n == 1),
            finished_ids=self._finished_ids,
            preempted_ids=preempted,
        )
        self._finished_ids = []
        return out

    def _to_plain(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids[start : start + n],
            start_pos=start,
            block_tables=req.block_tables,
            sample=start + n == req.num_tokens,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.block_tables)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what must stop.

        Returns the requests that received a token this step.
        """
        got_token = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted during the step
            req.num_computed_tokens += len(s.token_ids)
            if not s.sample:
                continue
            token = sampled[s.request_id]
            req.append_token(token)
            got_token.append(req)
            self._check_stop(req, token)
        return got_token

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.finish(req, "stop")
            if token in params.stop_token_ids:
                return self.finish(req, "stop", token)
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return self.finish(req, "length")
        if req.num_tokens >= self.config.max_model_len:
            return self.finish(req, "length")
        return None
