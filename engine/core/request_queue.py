"""Queued requests, best ``(priority, arrival_time)`` first, with their token count. Pure Python.

A heap with lazy removal: ``push`` is O(log n), ``remove`` O(1) (the heap entry stays behind,
marked stale by its serial number), ``peek`` and ``pop`` O(log n) amortized, ``len`` and
``num_tokens`` O(1). So a queue of 100k requests costs no more per admission than a short one.

Among equal keys the order is that of a deque: ``push(front=True)`` goes before every member,
``push()`` after every member.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request

# (priority, arrival_time, serial, request); serials are unique, so requests are never compared.
_Entry = tuple[int, float, int, "Request"]


def queue_key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


class RequestQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._members: dict[str, tuple[int, int, Request]] = {}  # id -> (serial, tokens, req)
        self._back = 0  # next serial for push(); it grows
        self._front = 0  # last serial given by push(front=True); it shrinks
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the members have still to compute, as counted when each was pushed."""
        return self._num_tokens

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, req: Request) -> bool:
        member = self._members.get(req.request_id)
        return member is not None and member[2] is req

    def __iter__(self) -> Iterator[Request]:
        """The members, in no particular order."""
        return (req for _, _, req in list(self._members.values()))

    def push(self, req: Request, front: bool = False) -> None:
        if req.request_id in self._members:
            raise ValueError(f"request {req.request_id!r} is already queued")
        if front:
            self._front -= 1
            serial = self._front
        else:
            serial = self._back
            self._back += 1
        tokens = req.num_tokens - req.num_computed_tokens
        self._members[req.request_id] = (serial, tokens, req)
        self._num_tokens += tokens
        heapq.heappush(self._heap, (*queue_key(req), serial, req))

    def remove(self, req: Request) -> None:
        """Takes ``req`` out; its heap entry goes stale and is dropped when it surfaces."""
        if req not in self:
            raise KeyError(req.request_id)
        _, tokens, _ = self._members.pop(req.request_id)
        self._num_tokens -= tokens
        if len(self._heap) > 2 * len(self._members) + 16:
            self._compact()

    def peek(self) -> Request | None:
        """The best member, or None when the queue is empty."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty RequestQueue")
        self.remove(req)
        return req

    def _live(self, entry: _Entry) -> bool:
        member = self._members.get(entry[3].request_id)
        return member is not None and member[0] == entry[2]

    def _compact(self) -> None:
        # Stale entries outnumber live ones: rebuilding costs O(n), paid for by the removals.
        self._heap = [e for e in self._heap if self._live(e)]
        heapq.heapify(self._heap)
