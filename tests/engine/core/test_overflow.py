"""Overflow policies with a fake runner that keeps a physical cache, and tiny pools.

The fake runner stores, in every cache slot it writes, the token and the position it was
computed at; a shift adds its delta to the positions in the blocks it names, as re-rotating
keys does; swaps copy slots between the device and host pools. Before each step it checks that
every position the step attends to holds the right token at the right position, through the
block tables (rings included). So a wrong table edit, a lost rotation or a bad swap fails there.
"""

from __future__ import annotations

import random

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.context_overflow import (
    CONTEXT_POLICIES,
    ContextOverflow,
    ContextState,
    Drop,
    ErrorPolicy,
    Finish,
    Fits,
    Reject,
    ShiftPolicy,
    SinkPolicy,
    StopPolicy,
    TruncatePolicy,
    context_policy,
)
from engine.core.errors import RequestError
from engine.core.kv_manager import KVCacheManager
from engine.core.preemption import Admission, Preemption
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from models.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec, SlidingWindowSpec

BS = 4


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 97


def greedy(n: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def state(prompt_len, limit=64, max_tokens=16, discard_end=None, bs=BS, **kw):
    """At admission, or (``on_full``) once a prompt of ``prompt_len`` has filled the context;
    by default a full cache's whole blocks can be discarded."""
    end = (limit - 1) // bs * bs if discard_end is None else discard_end
    return ContextState(prompt_len, max_tokens, limit, bs, end, **kw)


# ---- decisions ----


def test_error_refuses_prompt_plus_max_tokens_over_the_limit():
    policy = ErrorPolicy()
    assert policy.admit(state(48, max_tokens=16)) == Fits()
    refused = policy.admit(state(49, max_tokens=16))
    assert isinstance(refused, Reject) and "65 tokens" in refused.message
    assert isinstance(policy.admit(state(64, max_tokens=None)), Reject)
    assert policy.on_full(state(10, max_tokens=None)) == Finish()


def test_truncate_drops_oldest_prompt_tokens_after_n_keep():
    policy = TruncatePolicy(n_keep=5)
    assert policy.admit(state(40, max_tokens=16)) == Fits()
    assert policy.admit(state(60, max_tokens=16)) == Drop(5, 12)  # 48 left + 16 = 64
    assert policy.admit(state(70, max_tokens=None)) == Drop(5, 7)  # one token of room
    assert isinstance(policy.admit(state(70, max_tokens=60)), Reject)  # room 4 < n_keep
    assert TruncatePolicy(n_keep=-1).admit(state(70, max_tokens=8)).__class__ is Reject
    assert policy.on_full(state(10)) == Finish()


def test_stop_admits_any_max_tokens_and_finishes_at_the_limit():
    policy = StopPolicy()
    assert policy.admit(state(40, max_tokens=1000)) == Fits()
    assert isinstance(policy.admit(state(64, max_tokens=1)), Reject)
    assert policy.on_full(state(10)) == Finish()


def test_shift_keeps_n_keep_and_discards_half_the_rest_in_blocks():
    policy = ShiftPolicy(n_keep=5)  # rounded up to 8
    assert policy.on_full(state(10)) == Drop(8, 28)  # (64 - 8) / 2
    assert ShiftPolicy(n_keep=0, n_discard=5).on_full(state(10)) == Drop(0, 8)
    # The cache layout caps the drop; below one block the request stops instead.
    assert policy.on_full(state(10, discard_end=20)) == Drop(8, 12)
    assert policy.on_full(state(10, discard_end=11)) == Finish()
    assert policy.on_full(state(10, discard_end=4)) == Finish()  # ends before the kept ones
    assert policy.on_full(state(10, max_tokens=None)) == Finish()


def test_shift_stops_once_its_drops_would_pass_max_dropped():
    policy = ShiftPolicy(n_keep=4, n_discard=8)
    assert policy.on_full(state(10, dropped=24, max_dropped=32)) == Drop(4, 8)
    assert policy.on_full(state(10, dropped=28, max_dropped=32)) == Finish()


def test_shift_refuses_an_n_keep_that_leaves_nothing_to_discard():
    assert ShiftPolicy(n_keep=8).admit(state(30, max_tokens=500)) == Fits()
    refused = ShiftPolicy(n_keep=61).admit(state(30, max_tokens=500))
    assert isinstance(refused, Reject) and refused.code == "invalid_overflow"
    assert isinstance(ShiftPolicy().admit(state(64, max_tokens=500)), Reject)
    # A cache that will discard nothing past the kept tokens (a wrapped ring's window).
    assert isinstance(ShiftPolicy(n_keep=8).admit(state(30, discard_end=11)), Reject)


def test_shift_and_sink_need_a_model_that_rotates_its_keys():
    for policy in (ShiftPolicy(), SinkPolicy()):
        refused = policy.admit(state(30, can_rotate=False))
        assert isinstance(refused, Reject) and refused.code == "invalid_overflow"
    assert StopPolicy().admit(state(30, can_rotate=False)) == Fits()


def test_sink_evicts_one_block_after_the_sinks():
    assert SinkPolicy(n_keep=4).on_full(state(10)) == Drop(4, 4)
    assert SinkPolicy(n_keep=4, n_discard=6).on_full(state(10)) == Drop(4, 8)


def test_request_overflow_choices_are_validated():
    with pytest.raises(RequestError):
        ContextOverflow("rewind")
    with pytest.raises(RequestError):
        ContextOverflow("shift", n_discard=0)
    assert context_policy(ContextOverflow("sink", n_keep=2)) == SinkPolicy(2, None)


# A valid value for each setting, and the policies that read it: what each policy's object
# (context_policy) is built from, written out apart from the table the validator reads.
VALID = {"n_keep": 8, "n_discard": 16, "kv_budget": 32, "window": 8, "selection": "layer"}
READ_BY = {
    "n_keep": {"truncate", "shift", "sink", "snapkv", "h2o", "knorm"},
    "n_discard": {"shift", "sink", "snapkv", "h2o", "knorm"},
    "kv_budget": {"snapkv", "h2o", "knorm"},
    "window": {"snapkv", "h2o", "knorm"},
    "selection": {"snapkv", "h2o", "knorm"},
}


@pytest.mark.parametrize("policy", CONTEXT_POLICIES)
@pytest.mark.parametrize("name", sorted(VALID))
def test_a_setting_its_policy_does_not_read_is_refused_by_name(policy, name):
    if policy in READ_BY[name]:
        ContextOverflow(policy, **{name: VALID[name]})
        return
    with pytest.raises(RequestError, match=f"overflow.{name} does not apply") as e:
        ContextOverflow(policy, **{name: VALID[name]})
    assert e.value.param == f"overflow.{name}" and repr(policy) in e.value.message


def test_a_setting_is_read_when_its_policy_reads_it():
    # The values reach the policy objects, so the table above names what is really read.
    assert context_policy(ContextOverflow("truncate", n_keep=8)) == TruncatePolicy(8)
    assert context_policy(ContextOverflow("sink", n_keep=8, n_discard=16)) == SinkPolicy(8, 16)
    snap = context_policy(ContextOverflow("knorm", 8, 16, 32, 8, "layer"))
    assert (snap.sinks, snap.n_discard, snap.budget, snap.window, snap.per_head) == (
        8, 16, 32, 8, False,
    )  # fmt: skip


def test_an_n_discard_the_context_cannot_hold_is_refused_by_name():
    for policy in ("shift", "sink", "snapkv"):
        ContextOverflow(policy, n_discard=63).check_limit(64)
        for huge in (64, 10**30):
            with pytest.raises(RequestError, match="less than the context length") as e:
                ContextOverflow(policy, n_discard=huge).check_limit(64)
            assert e.value.param == "overflow.n_discard"
    ContextOverflow("shift").check_limit(64)  # the default discard fits any context


def test_preemption_picks_lowest_priority_then_latest_arrival():
    a = Request("a", [1], greedy(1), arrival_time=1.0, priority=0)
    b = Request("b", [1], greedy(1), arrival_time=2.0, priority=0)
    c = Request("c", [1], greedy(1), arrival_time=0.5, priority=1)
    assert Preemption("recompute").decide([a, b, c], lambda r: True) == (c, "recompute")
    assert Preemption("swap").decide([a, b], lambda r: True) == (b, "swap")
    assert Preemption("swap").decide([a, b], lambda r: False) == (b, "recompute")


def test_admission_bounds_the_queue_by_requests_and_tokens():
    assert Admission(max_queue_len=2).decide(1, 100, 1, 50) is None
    assert Admission(max_queue_len=2).decide(2, 100, 1, 50) == "queue_full"
    assert Admission(max_queue_len=4).decide(1, 100, 3, 50) is None  # a group fits whole
    assert Admission(max_queue_len=4).decide(2, 100, 3, 50) == "queue_full"  # or not at all
    assert Admission(max_queued_tokens=120).decide(1, 100, 1, 50) == "queued_tokens"
    assert Admission(max_queued_tokens=120).decide(0, 0, 1, 500) is None  # an empty queue admits


# ---- the scheduler with a fake paged runner ----


class PagedFakeRunner:
    """A cache of (token, position) per slot, checked through the block tables every step."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = sched.kv
        self.device = [{} for _ in self.kv.groups]  # (block, offset) -> (token, position)
        self.host = [{} for _ in self.kv.groups]

    def slot(self, gi: int, table: list[int], pos: int) -> tuple[int, int]:
        spec = self.kv.groups[gi].spec
        index = pos // BS
        if spec.window:
            index %= spec.ring_len(BS)
        assert index < len(table), f"group {gi}: position {pos} has no block"
        return table[index], pos % BS

    def execute(self, out) -> dict[str, int]:
        for shift in out.shifts:
            for gi, blocks in enumerate(shift.blocks):
                for b in blocks:
                    for off in range(BS):
                        if (b, off) in self.device[gi]:
                            tok, pos = self.device[gi][b, off]
                            self.device[gi][b, off] = (tok, pos + shift.delta)
        for src, dst, pairs_by_group in (
            (self.device, self.host, out.swap_out),
            (self.host, self.device, out.swap_in),
        ):
            for gi, pairs in enumerate(pairs_by_group):
                for a, b in pairs:
                    for off in range(BS):
                        dst[gi].pop((b, off), None)
                        if (a, off) in src[gi]:
                            dst[gi][b, off] = src[gi][a, off]
        sampled = {}
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            context = req.token_ids[: s.start_pos + len(s.token_ids)]
            assert context[s.start_pos :] == s.token_ids
            for gi, group in enumerate(self.kv.groups):
                window = group.spec.window
                first = max(0, s.start_pos - window + 1) if window else 0
                for p in range(first, s.start_pos):
                    held = self.device[gi].get(self.slot(gi, s.block_tables[gi], p))
                    assert held == (context[p], p), f"group {gi} position {p}: {held}"
                for i, tok in enumerate(s.token_ids):
                    p = s.start_pos + i
                    self.device[gi][self.slot(gi, s.block_tables[gi], p)] = (tok, p)
            if s.sample:
                sampled[s.request_id] = [next_token(context)]
        return sampled


def make(groups, num_blocks, *, max_len=32, budget=16, max_seqs=4, mode="recompute", host=()):
    kv = KVCacheManager(CacheConfig(groups, BS, num_blocks, host))
    config = SchedulerConfig(max_seqs, budget, max_len, mode)
    return Scheduler(config, kv, StopPolicy()), kv


def run(sched: Scheduler, kv: KVCacheManager, runner: PagedFakeRunner | None = None):
    runner = runner or PagedFakeRunner(sched)
    for _ in range(5000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        live = sched.live_requests
        kv.check_integrity([r.block_tables for r in live], [r.host_tables for r in live])
    assert not sched.has_unfinished
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.num_free_host_blocks == kv.num_total_host_blocks


def expected_with_drops(prompt, max_tokens, limit, plan) -> list[int]:
    """The output when ``plan(context)`` (start, count) is dropped whenever the context is full."""
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        ctx.append(next_token(ctx))
        out.append(ctx[-1])
        if len(out) < max_tokens and len(ctx) >= limit:
            start, count = plan(ctx)
            del ctx[start : start + count]
    return out


FULL = KVCacheGroup(FullAttentionSpec(1, 4), (0,))
MLA = KVCacheGroup(MLASpec(8, 4), (0,))
RING = KVCacheGroup(SlidingWindowSpec(1, 4, window_size=6), (1,))  # ring of 3 blocks
WIDE_RING = KVCacheGroup(SlidingWindowSpec(1, 4, window_size=40), (1,))  # never wraps at 32


@pytest.mark.parametrize(
    "groups",
    [[FULL], [MLA], [RING, FULL], [WIDE_RING, FULL]],
    ids=["full", "mla", "ring+full", "wide-ring+full"],
)
@pytest.mark.parametrize("policy", ["shift", "sink"])
def test_shift_and_sink_generate_past_the_limit_with_every_position_in_place(groups, policy):
    limit, keep = 32, 4
    sched, kv = make(groups, (12,) * len(groups), max_len=limit)
    choice = context_policy(ContextOverflow(policy, n_keep=keep))
    reqs = []
    for i, n in enumerate([7, 13]):
        req = Request(f"r{i}", [(i * 7 + j) % 97 for j in range(n)], greedy(100))
        req.context_policy = choice
        reqs.append(req)
        sched.add_request(req)
    run(sched, kv)

    def plan(ctx):
        if policy == "sink":
            return keep, BS
        most = (limit - 1) // BS * BS - keep
        if any(g.spec.window and g.spec.window < limit for g in groups):
            most = min(most, (limit - 1 - keep - (6 - 1)) // BS * BS)
        return keep, min(-(-(limit - keep) // 2 // BS) * BS, most)  # half, up to a block

    for r in reqs:
        assert r.finish_reason == "length" and r.num_output_tokens == 100
        assert r.output_token_ids == expected_with_drops(r.prompt_token_ids, 100, limit, plan)
        assert r.num_dropped_tokens > 0


def test_stop_finishes_at_the_limit():
    sched, kv = make([FULL], (12,), max_len=32)
    req = Request("a", list(range(10)), greedy(100))
    sched.add_request(req)
    run(sched, kv)
    assert req.finish_reason == "length" and req.num_tokens == 32
    assert sched.drain_events().context_overflows == {"stop": 1}


def test_a_prompt_drop_at_admission_is_carried_out_and_counted_by_the_scheduler():
    sched, kv = make([RING, FULL], (12, 12), max_len=32)
    prompt = [(7 * j) % 97 for j in range(40)]
    req = Request("a", prompt, greedy(8), context_policy=TruncatePolicy(n_keep=4))
    drop = req.context_policy.admit(state(40, limit=32, max_tokens=8))
    assert drop == Drop(4, 16)  # 24 prompt tokens leave room for 8
    sched.add_request(req, drop)
    kept = prompt[:4] + prompt[20:]
    assert req.token_ids == kept and sched.num_waiting_tokens == 24
    run(sched, kv)
    assert req.output_token_ids == expected_with_drops(kept, 8, 32, None)
    assert req.num_dropped_tokens == 16 and req.prompt_token_ids == prompt
    assert sched.events.context_overflows == {"truncate": 1}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_too_small_preempts_and_every_request_finishes_as_if_alone(mode):
    # Six requests of up to 40 tokens need 6 * 10 blocks; the pool has 14 (and a ring group).
    sched, kv = make([RING, FULL], (14, 14), max_len=64, mode=mode, host=(20, 20))
    rng = random.Random(0)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(5, 20))]
        reqs.append(Request(f"r{i}", prompt, greedy(20), arrival_time=float(i)))
        sched.add_request(reqs[-1])
    run(sched, kv)
    events = sched.events  # not drained by run()
    for r in reqs:
        plan = None  # the context never fills
        assert r.output_token_ids == expected_with_drops(r.prompt_token_ids, 20, 64, plan)
    assert sched.num_preemptions > 0
    assert set(events.preemptions) == {mode}
    if mode == "swap":
        assert events.swapped_blocks["out"] == events.swapped_blocks["in"] > 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched, kv = make([FULL], (14,), max_len=64, mode="swap", host=(3,))
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(i, i + 15)), greedy(20)))
    run(sched, kv)
    assert {"swap", "recompute"} <= set(sched.events.preemptions)


def test_a_better_priority_request_preempts_a_worse_running_one():
    # Each fits the 8-block pool alone (7 and 7 blocks); together they do not.
    sched, kv = make([FULL], (8,), max_len=64, budget=64)
    low = Request("low", list(range(12)), greedy(16), arrival_time=0.0, priority=1)
    high = Request("high", list(range(20)), greedy(8), arrival_time=1.0, priority=0)
    sched.add_request(low)
    runner = PagedFakeRunner(sched)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.add_request(high)
    out = sched.schedule()
    assert out.preempted_ids == ["low"] and [s.request_id for s in out.scheduled] == ["high"]
    sched.update(out, runner.execute(out))
    run(sched, kv, runner)
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    for r, n in ((low, 16), (high, 8)):
        assert r.output_token_ids == expected_with_drops(r.prompt_token_ids, n, 64, None)
