"""RequestQueue against the plain deque it replaces: the same best request after any mix of
pushes (back and front), removals, re-pushes and pops, and the same token count."""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine.core.request import Request
from engine.core.request_queue import RequestQueue
from engine.core.sampling_params import SamplingParams


def request(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(), arrival, priority)


def best(reference: deque[Request]) -> Request | None:
    """What the scheduler computed before: the first of the minimal keys in deque order."""
    return min(reference, key=lambda r: (r.priority, r.arrival_time), default=None)


def test_pop_order_is_priority_then_arrival():
    q = RequestQueue()
    reqs = [request("late", 3, 0, 2.0), request("low", 3, 1, 0.0), request("early", 3, 0, 1.0)]
    for r in reqs:
        q.push(r)
    assert [q.pop().request_id for _ in range(3)] == ["early", "late", "low"]
    assert q.peek() is None and len(q) == 0 and q.num_tokens == 0


def test_equal_keys_keep_deque_order_front_pushes_first():
    q = RequestQueue()
    a, b, c, d = (request(x, 1) for x in "abcd")
    q.push(a)
    q.push(b)
    q.push(c, front=True)
    q.push(d, front=True)
    assert [q.pop().request_id for _ in range(4)] == ["d", "c", "a", "b"]


def test_removed_request_is_gone_and_can_come_back():
    q = RequestQueue()
    first, second = request("first", 5, 0, 0.0), request("second", 7, 0, 1.0)
    q.push(first)
    q.push(second)
    q.remove(first)
    assert first not in q and second in q and len(q) == 1
    assert q.peek() is second and q.num_tokens == 7
    with pytest.raises(KeyError):
        q.remove(first)
    q.push(first, front=True)
    assert q.peek() is first and q.num_tokens == 12
    assert sorted(r.request_id for r in q) == ["first", "second"]
    q.remove(first)
    assert q.pop() is second and q.peek() is None


def test_token_count_is_what_was_left_to_compute_at_push():
    q = RequestQueue()
    r = request("r", 10)
    r.num_computed_tokens = 4
    q.push(r)
    assert q.num_tokens == 6
    r.num_computed_tokens = 9  # a change while queued does not skew the count at removal
    q.remove(r)
    assert q.num_tokens == 0


def test_a_request_cannot_be_queued_twice():
    q = RequestQueue()
    r = request("r", 1)
    q.push(r)
    with pytest.raises(ValueError):
        q.push(r)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_the_deque_reference(seed):
    rng = random.Random(seed)
    q, reference = RequestQueue(), deque()
    # Few priorities and arrival times: many equal keys, whose deque order must hold.
    outside = [
        request(f"r{i}", rng.randrange(1, 50), rng.randrange(3), rng.randrange(6))
        for i in range(60)
    ]
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and outside:
            r = outside.pop(rng.randrange(len(outside)))
            front = rng.random() < 0.3
            q.push(r, front=front)
            (reference.appendleft if front else reference.append)(r)
        elif op < 0.7 and reference:
            r = reference[rng.randrange(len(reference))]
            reference.remove(r)
            q.remove(r)
            outside.append(r)
        elif reference:
            expected = best(reference)
            reference.remove(expected)
            assert q.pop() is expected
            outside.append(expected)
        assert q.peek() is best(reference)
        assert len(q) == len(reference)
        assert q.num_tokens == sum(r.num_tokens for r in reference)
        assert {r.request_id for r in q} == {r.request_id for r in reference}
