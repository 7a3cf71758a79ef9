"""Stored responses of ``/v1/responses``: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues.

A bounded, in-memory LRU: at most ``max_entries`` responses and ``max_bytes`` bytes, the least
recently stored or read going first. Each entry holds its whole conversation (every earlier
turn, this turn's input and its output), so a continuation needs no other entry; its size is
counted as the JSON of the response and of that conversation. The store lives on the event loop
(every caller is a route handler), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.core.errors import RequestError
from server.protocol import ChatMessage


class ResponseNotFoundError(RequestError):
    status = 404

    def __init__(self, response_id: str, param: str | None = None):
        message = (
            f"No response with id `{response_id}` is stored here: it was never stored "
            "(store: false), was deleted, or was evicted from the response store."
        )
        code = "previous_response_not_found" if param else "response_not_found"
        super().__init__(message, param=param, code=code)


@dataclass(frozen=True)
class StoredResponse:
    body: str  # the response object, as JSON
    conversation: tuple[ChatMessage, ...]  # every turn so far, ending with this response's output
    size: int

    @classmethod
    def of(cls, body: str, conversation: list[ChatMessage]) -> StoredResponse:
        size = len(body) + sum(len(m.model_dump_json()) for m in conversation)
        return cls(body, tuple(conversation), size)


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Stores ``entry``, evicting the least recently used until both limits hold; an entry
        larger than the whole store is not kept."""
        self.delete(response_id)
        if self.max_entries < 1 or entry.size > self.max_bytes:
            return
        self._entries[response_id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, now the most recently used; 404 when it is not here."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
