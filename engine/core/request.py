"""One request's state as the scheduler sees it. Pure Python."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.context_overflow import ContextPolicy


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its cache kept in host memory
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first and is preempted last
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # The tokens the KV cache holds or will hold, in position order. Starts as the prompt and
    # grows by each sampled token; context policies may drop tokens from it.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    host_tables: list[list[int]] = field(default_factory=list)  # swap-pool blocks while swapped
    context_policy: ContextPolicy | None = None  # None: the scheduler's default
    num_dropped_tokens: int = 0  # removed from token_ids by the context policy
    # Evicted by an importance policy: the cache keeps its tokens at their positions, compacted
    # into fewer slots, so a token at position p computed since sits in slot p - num_evicted.
    num_evicted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Speculative decoding: the measured rate at which this request's drafts are accepted
    # (None: not measured yet), and the positions a draft model's cache holds for it.
    acceptance: float | None = None
    num_draft_computed: int = 0
    # Prefix caching: the keys of the full blocks of token_ids, how many of the sequence's
    # blocks are registered in the cache, and the prompt tokens served from it at admission.
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, position: int) -> int:
        """The cache slot of the token at ``position``, once computed after any eviction."""
        return position - self.num_evicted

    @property
    def num_cached_slots(self) -> int:
        return self.num_computed_tokens - self.num_evicted

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def drop_tokens(self, start: int, count: int) -> None:
        """Remove ``count`` tokens at ``start`` from the context; cached ones included."""
        del self.token_ids[start : start + count]
        if self.num_computed_tokens > start:
            self.num_computed_tokens -= min(count, self.num_computed_tokens - start)
        if self.num_draft_computed > start:
            self.num_draft_computed -= min(count, self.num_draft_computed - start)
        self.num_dropped_tokens += count
