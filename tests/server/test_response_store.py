"""The Responses store: least recently used out first, and a byte bound that holds in memory,
measured by tracemalloc."""

from __future__ import annotations

import fnmatch
import gc
import tracemalloc

import pytest

import server.response_store
from server.protocol import ChatMessage
from server.response_store import ResponseNotFoundError, ResponseStore, StoredResponse


def entry(size: int) -> StoredResponse:
    return StoredResponse.of("x" * size, [])


def test_the_store_evicts_the_least_recently_used_by_count_and_bytes():
    one = entry(10).size("a")  # every id is one character: every small entry is this size
    store = ResponseStore(max_entries=2, max_bytes=one * 10)
    store.put("a", entry(10))
    store.put("b", entry(10))
    store.get("a")  # now b is the least recently used
    store.put("c", entry(10))
    assert [k for k in "abc" if k in store._entries] == ["a", "c"] and store.bytes == 2 * one
    store.put("d", entry(one * 9))  # over the bytes: a and c go
    assert list(store._entries) == ["d"] and store.bytes == entry(one * 9).size("d")
    store.put("e", entry(one * 10))  # larger than the store: not kept
    with pytest.raises(ResponseNotFoundError):
        store.get("e")
    assert store.delete("d") and not store.delete("d") and store.bytes == 0


def allocated_here(put) -> int:
    """Bytes still allocated after ``put()`` by this file or the store's module (so by the
    entries, ids included), not by other threads of the test process nor by tracemalloc's
    own snapshots."""
    files = [
        *(tracemalloc.Filter(True, f, all_frames=True)
          for f in (__file__, server.response_store.__file__)),
        *(tracemalloc.Filter(False, f, all_frames=True)
          for f in (tracemalloc.__file__, fnmatch.__file__, "<frozen abc>")),
    ]  # fmt: skip
    gc.collect()
    tracemalloc.start(8)
    try:
        before = tracemalloc.take_snapshot().filter_traces(files)
        put()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(files)
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


@pytest.mark.parametrize(("n_entries", "n_messages"), [(1, 1000), (1000, 1), (40, 200)])
def test_the_store_holds_no_more_memory_than_it_counts(n_entries, n_messages):
    """Short messages are the worst case for counting text: an object per message dwarfs it.
    (1000, 1) passes the bound, so eviction frees what it uncounts."""
    conversation = [ChatMessage(role="user", content="x") for _ in range(n_messages)]
    max_bytes = 1 << 18
    store = ResponseStore(max_entries=10_000, max_bytes=max_bytes)

    def put() -> None:
        for i in range(n_entries):
            store.put(f"resp_{i:032x}", StoredResponse.of(f'{{"id": {i}}}', conversation))

    held = allocated_here(put)
    assert len(store) > 0 and 0 < held <= store.bytes <= max_bytes
    last = store.get(f"resp_{n_entries - 1:032x}")
    assert last.conversation == conversation  # what a continuation reads back


def test_a_response_deleted_in_flight_is_not_stored_when_it_ends():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20)
    store.reserve("r")
    with pytest.raises(ResponseNotFoundError):
        store.get("r")  # in flight: nothing to show yet
    assert store.delete("r") and not store.delete("r")
    store.finish("r", entry(10))
    with pytest.raises(ResponseNotFoundError):
        store.get("r")
    store.reserve("s")
    store.finish("s", entry(10))
    store.finish("s", None)  # a second end changes nothing
    assert store.get("s").body == b"x" * 10 and store.bytes == entry(10).size("s")
    store.reserve("t")
    store.finish("t", None)  # ended without an answer (a failure, a disconnect)
    assert not store.delete("t") and not store._pending
