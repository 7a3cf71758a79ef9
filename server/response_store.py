"""Stored responses of ``/v1/responses``: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues.

A bounded, in-memory LRU: at most ``max_entries`` responses and ``max_bytes`` bytes of memory,
the least recently stored or read going first. Each entry holds its whole conversation (every
earlier turn, this turn's input and its output), so a continuation needs no other entry. An
entry is kept as two byte strings, the JSON of the response and of that conversation, parsed
again when read: Python objects would take several times the size of their text, so a bound
counted on the text would not bound the memory. Its size is those bytes plus a fixed
``ENTRY_OVERHEAD`` for the objects around them.

A response in flight is ``reserved`` by its id until it ends: a DELETE meanwhile answers as
for a stored one and the response is then not stored, so no id a DELETE was told is gone
appears afterwards. The store lives on the event loop (every caller is a route handler), so it
needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pydantic import TypeAdapter

from engine.core.errors import RequestError
from server.protocol import ChatMessage

# Bytes an entry holds besides its two JSON strings and its id's characters: the headers of
# those three objects, the entry object, and its share of the ordered dict's tables and links
# (at most about 200 bytes once the dict has grown). tests/server/test_responses.py measures
# that a full store holds no more than it counts.
ENTRY_OVERHEAD = 512
CONVERSATION = TypeAdapter(list[ChatMessage])


class ResponseNotFoundError(RequestError):
    status = 404

    def __init__(self, response_id: str, param: str | None = None):
        message = (
            f"No response with id `{response_id}` is stored here: it was never stored "
            "(store: false), was deleted, or was evicted from the response store."
        )
        code = "previous_response_not_found" if param else "response_not_found"
        super().__init__(message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: bytes  # the response object, as JSON
    conversation_json: bytes  # every turn so far, ending with this response's output

    @classmethod
    def of(cls, body: str, conversation: list[ChatMessage]) -> StoredResponse:
        return cls(body.encode(), CONVERSATION.dump_json(conversation, exclude_none=True))

    @property
    def conversation(self) -> list[ChatMessage]:
        return CONVERSATION.validate_json(self.conversation_json)

    def size(self, response_id: str) -> int:
        """The memory this entry holds under ``response_id``, at most."""
        return ENTRY_OVERHEAD + len(response_id) + len(self.body) + len(self.conversation_json)


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # In flight, by id: whether it has been deleted before it ended.
        self._pending: dict[str, bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, response_id: str) -> None:
        """Makes a response in flight known, so that a DELETE of it finds it."""
        self._pending[response_id] = False

    def finish(self, response_id: str, entry: StoredResponse | None) -> None:
        """The response ``reserve``d has ended: stored unless it was deleted meanwhile (or
        ``entry`` is None: it is not to be stored)."""
        deleted = self._pending.pop(response_id, False)
        if entry is not None and not deleted:
            self.put(response_id, entry)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Stores ``entry``, evicting the least recently used until both limits hold; an entry
        larger than the whole store is not kept."""
        self._remove(response_id)
        size = entry.size(response_id)
        if self.max_entries < 1 or size > self.max_bytes:
            return
        self._entries[response_id] = entry
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            evicted_id, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size(evicted_id)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, now the most recently used; 404 when it is not here (nor while it is
        still in flight: it has no answer to give yet)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Removes a stored response, or marks one in flight not to be stored; False when
        there is neither."""
        if self._pending.get(response_id) is False:
            self._pending[response_id] = True
            return True
        return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size(response_id)
        return entry is not None
