"""Scheduler behaviour with a fake runner: chunking, budgets, preemption, no lost blocks."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.context_overflow import StopPolicy
from engine.core.kv_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from models.kv_spec import FullAttentionSpec, KVCacheGroup

GROUP = KVCacheGroup(FullAttentionSpec(1, 4), (0,))
BS = 8


def next_token(context: list[int]) -> int:
    """The fake model: the next token depends on the whole context, as a real one's does."""
    return (sum(context) * 31 + len(context)) % 97


def make(num_blocks=64, budget=32, max_seqs=8, max_len=256):
    kv = KVCacheManager(
        CacheConfig([KVCacheGroup(FullAttentionSpec(1, 4), (0,))], BS, (num_blocks,))
    )
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), kv, StopPolicy()), kv


class FakeRunner:
    """Checks what a real runner would rely on, and 'computes' by replaying the context."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.cached: dict[str, list[int]] = {}  # what each request's cache holds

    def execute(self, out):
        sampled = {}
        for s in out.scheduled[: out.num_decodes]:
            assert len(s.token_ids) == 1
        for s in out.scheduled:
            cache = self.cached.setdefault(s.request_id, [])
            del cache[s.start_pos :]  # recompute after preemption starts over
            assert len(cache) == s.start_pos, "a chunk must start where the cache ends"
            cache.extend(s.token_ids)
            assert len(s.block_tables[0]) * BS >= len(cache), "blocks must cover the context"
            if s.sample:
                sampled[s.request_id] = [next_token(cache)]
        return sampled


def run_to_completion(sched, kv, max_steps=10_000):
    runner = FakeRunner(sched)
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        steps.append(out)
        sched.update(out, runner.execute(out))
        kv.check_integrity([r.block_tables for r in sched.live_requests])
    assert not sched.has_unfinished
    assert kv.num_free_blocks == kv.num_total_blocks
    return steps


def expected_output(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0)


def test_long_prompt_is_prefilled_in_chunks_within_budget():
    sched, kv = make(budget=16)
    req = Request("a", list(range(1, 51)), greedy(3))
    sched.add_request(req)
    steps = run_to_completion(sched, kv)
    chunks = [(s.scheduled[0].start_pos, len(s.scheduled[0].token_ids)) for s in steps]
    assert chunks[:4] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert [s.scheduled[0].sample for s in steps[:4]] == [False, False, False, True]
    assert chunks[4:] == [(50, 1), (51, 1)]
    assert req.output_token_ids == expected_output(req.prompt_token_ids, 3)


def test_decodes_share_a_step_with_a_prefill_chunk_and_come_first():
    sched, kv = make(budget=20)
    short = Request("short", [1, 2, 3], greedy(6))
    sched.add_request(short)
    runner = FakeRunner(sched)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.add_request(Request("long", list(range(40)), greedy(2)))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["short", "long"]
    assert out.num_decodes == 1
    assert len(out.scheduled[1].token_ids) == 19  # the rest of the budget
    sched.update(out, runner.execute(out))


def test_pool_too_small_for_all_requests_loses_none():
    # 6 requests of up to 60 tokens need 6 * 8 = 48 blocks; the pool has 14.
    sched, kv = make(num_blocks=14, budget=24)
    rng = random.Random(0)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(5, 40))]
        reqs.append(Request(f"r{i}", prompt, greedy(20)))
        sched.add_request(reqs[-1])
    run_to_completion(sched, kv)
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 20)
    assert sched.num_preemptions > 0


def test_waiting_requests_respect_max_num_seqs():
    sched, kv = make(max_seqs=2, budget=100)
    for i in range(5):
        sched.add_request(Request(f"r{i}", [1, 2, 3], greedy(4)))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3
    run_to_completion(sched, kv)


def test_abort_returns_blocks_and_is_reported_to_the_runner():
    sched, kv = make()
    sched.add_request(Request("a", list(range(30)), greedy(50)))
    out = sched.schedule()
    sched.update(out, FakeRunner(sched).execute(out))
    assert kv.num_free_blocks < kv.num_total_blocks
    sched.abort("a")
    assert kv.num_free_blocks == kv.num_total_blocks
    assert sched.schedule().finished_ids == ["a"]


def test_eos_stop_tokens_and_context_limit_finish_requests():
    kv = KVCacheManager(CacheConfig([GROUP], BS, (64,)))
    prompt = [5, 6, 7]
    eos = expected_output(prompt, 3)[2]
    sched = Scheduler(SchedulerConfig(8, 32, 12), kv, StopPolicy(), eos_token_ids=(eos,))
    a = Request("a", prompt, greedy(10))
    b = Request("b", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    c = Request("c", [9] * 8, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    for r in (a, b, c):
        sched.add_request(r)
    run_to_completion(sched, kv)
    assert a.finish_reason == "stop" and len(a.output_token_ids) == 3
    assert b.finish_reason == "length" and len(b.output_token_ids) == 9  # 3 + 9 = max_len 12
    assert c.finish_reason == "length" and c.num_tokens == 12
