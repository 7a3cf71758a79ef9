"""Pool overflow: which running request gives its KV blocks back, and how; and admission
control, which refuses a request (429) rather than let the queue grow without bound. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class Preemption:
    """No free block for a running sequence: who gives its blocks back, and how.

    The victim is the lowest-priority request (highest ``priority`` value), the latest arrived
    among equals. ``swap`` keeps its cache in host memory while the swap pool has room, and
    falls back to recomputing it otherwise.
    """

    mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}: {self.mode!r}")

    def decide(
        self, running: list[Request], can_swap: Callable[[Request], bool]
    ) -> tuple[Request, str]:
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        if self.mode == "swap" and can_swap(victim):
            return victim, "swap"
        return victim, "recompute"


@dataclass(frozen=True)
class Admission:
    """A bounded queue: a request beyond it is refused (429) rather than left waiting."""

    max_queue_len: int | None = None
    max_queued_tokens: int | None = None

    def decide(
        self, num_waiting: int, waiting_tokens: int, new_requests: int, new_tokens: int
    ) -> str | None:
        """None to admit ``new_requests`` (a group, all or none), else the reason for refusing."""
        if self.max_queue_len is not None and num_waiting + new_requests > self.max_queue_len:
            return "queue_full"
        if (
            self.max_queued_tokens is not None
            and num_waiting > 0
            and waiting_tokens + new_tokens > self.max_queued_tokens
        ):
            return "queued_tokens"
        return None
