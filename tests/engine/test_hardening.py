"""No request can stall, crash or starve another, with a tiny random Llama on the CPU.

The oracle is a greedy canary: its tokens beside any other request (extreme sampling values, a
request whose sampling or post-processing fails) must equal its tokens when run alone. Groups
are admitted all or none, values outside the documented ranges are refused naming the field,
and shift/sink stop after ``max_overflow_tokens`` discarded tokens.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs, add_cli_args, from_cli_args
from engine.core.errors import QueueFullError, RequestError
from engine.core.sampling_params import INT64, REPETITION_PENALTY
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import Admitted, LLMEngine
from engine.worker.sampler import Sampler
from tests.helpers import TINY_LLAMA, random_prompt

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = TINY_LLAMA["vocab_size"]
LIMIT = 64
CANARY = random_prompt(12, VOCAB, seed=1)
OTHER = random_prompt(9, VOCAB, seed=2)
STEPS = 8


def make(path, **kw) -> LLM:
    args = dict(max_model_len=LIMIT, num_kv_blocks=32, block_size=8, device="cpu")
    return LLM(str(path), dtype="float32", **{**args, **kw})


def greedy(n: int = STEPS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def alone(path, prompt: list[int], params: SamplingParams) -> list[int]:
    (out,) = make(path).generate([prompt], params)
    return out.outputs[0].token_ids


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def metric(engine: LLMEngine, name: str, **labels) -> float:
    value = engine.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def canary_alone(tiny_llama_dir) -> list[int]:
    return alone(tiny_llama_dir, CANARY, greedy())


# ---- extreme values that pass validation ----

RP_LOW, RP_HIGH = REPETITION_PENALTY
# Values at the edges of the allowed ranges whose sampling is greedy in effect.
GREEDY_IN_EFFECT = {
    "temperature_1e-50": dict(temperature=1e-50),
    "top_k_1": dict(temperature=1.0, top_k=1, seed=5),
    "min_p_1": dict(temperature=1.0, min_p=1.0, seed=5),
    "top_p_1e-9": dict(temperature=1.0, top_p=1e-9, seed=5),
}
# Other edges: they must sample valid tokens with finite logprobs.
EDGES = {
    "repetition_penalty_min": dict(temperature=1e-5, repetition_penalty=RP_LOW, logprobs=20),
    "repetition_penalty_max": dict(temperature=1e-5, repetition_penalty=RP_HIGH, logprobs=20),
    "penalties_max": dict(temperature=1e30, presence_penalty=2, frequency_penalty=2, logprobs=0),
    "penalties_min": dict(
        temperature=1e-5, presence_penalty=-2, frequency_penalty=-2, repetition_penalty=RP_LOW
    ),
    "seed_int64_max": dict(temperature=1.0, seed=INT64[1]),
    "seed_int64_min": dict(temperature=1.0, seed=INT64[0]),
}


def run_beside_canary(path, params: SamplingParams, prompt=OTHER):
    llm = make(path)
    canary, other = llm.generate([CANARY, prompt], [greedy(), params])
    assert_all_blocks_free(llm.engine)
    return canary.outputs[0], other.outputs[0]


@pytest.mark.parametrize("values", GREEDY_IN_EFFECT.values(), ids=GREEDY_IN_EFFECT.keys())
def test_greedy_in_effect_edges_match_greedy_and_leave_the_canary_alone(
    tiny_llama_dir, canary_alone, values
):
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, **values)
    canary, other = run_beside_canary(tiny_llama_dir, params)
    assert canary.token_ids == canary_alone
    assert other.finish_reason == "length" and other.error is None
    assert other.token_ids == alone(tiny_llama_dir, OTHER, greedy())


@pytest.mark.parametrize("values", EDGES.values(), ids=EDGES.keys())
def test_sampling_at_the_range_edges_leaves_the_canary_alone(tiny_llama_dir, canary_alone, values):
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, **values)
    canary, other = run_beside_canary(tiny_llama_dir, params)
    assert canary.token_ids == canary_alone
    assert other.finish_reason == "length" and other.error is None
    assert len(other.token_ids) == STEPS and all(0 <= t < VOCAB for t in other.token_ids)
    for lp in other.logprobs or []:
        assert torch.isfinite(torch.tensor(lp.logprob))
    if params.seed is not None:  # a seed makes the request reproducible beside anything
        assert other.token_ids == alone(tiny_llama_dir, OTHER, params)


def test_min_tokens_holds_back_the_stop_tokens_greedy_would_pick(tiny_llama_dir, canary_alone):
    stops = tuple(alone(tiny_llama_dir, OTHER, greedy()))
    params = greedy(STEPS, min_tokens=STEPS, stop_token_ids=stops)
    canary, other = run_beside_canary(tiny_llama_dir, params)
    assert canary.token_ids == canary_alone
    assert other.finish_reason == "length" and len(other.token_ids) == STEPS
    assert not set(other.token_ids) & set(stops)


def test_sampler_stays_finite_where_unshifted_scaling_would_overflow():
    # The penalty takes logits to 1e36 and 1/temperature to 1e41: beyond fp32 unless shifted.
    logits = torch.linspace(-1e34, 1e34, VOCAB).unsqueeze(0)
    sampler = Sampler(0, (), torch.device("cpu"))
    params = SamplingParams(temperature=1e-5, repetition_penalty=RP_LOW, logprobs=5, seed=1)
    ((token, lp),) = sampler.sample(logits, ["r"], [params], [[VOCAB - 1]], [[]])
    assert token == VOCAB - 1
    assert torch.isfinite(torch.tensor([lp.logprob, *(v for _, v in lp.top)])).all()


# ---- values outside the ranges ----

OUT_OF_RANGE = [
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-1e-9), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("inf")), "min_p"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
    (dict(repetition_penalty=1e-80), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=RP_HIGH * 1.01), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(seed=2**64), "seed"),
    (dict(seed=INT64[1] + 1), "seed"),
    (dict(seed=INT64[0] - 1), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
]


@pytest.mark.parametrize(("values", "param"), OUT_OF_RANGE, ids=[str(v) for v, _ in OUT_OF_RANGE])
def test_values_out_of_range_are_refused_naming_the_field(values, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(**values)
    assert e.value.param == param and e.value.status == 400
    assert str(e.value).startswith(param)


@pytest.mark.parametrize("stop", [[10**9], [VOCAB], [0, VOCAB + 1]])
def test_stop_token_ids_beyond_the_vocabulary_are_refused(tiny_llama_dir, stop):
    engine = make(tiny_llama_dir).engine
    with pytest.raises(RequestError) as e:
        engine.add_request("r", CANARY, greedy(stop_token_ids=stop))
    assert e.value.param == "stop_token_ids"
    assert_all_blocks_free(engine)


# ---- one request's failure stays its own ----


def poisoned(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.7, seed=3, extra={"poison": True}, **kw)


def assert_failed_alone(llm: LLM, outs, canary_alone, stage: str) -> None:
    canary, bad = (o.outputs[0] for o in outs)
    assert canary.token_ids == canary_alone and canary.finish_reason == "length"
    assert bad.finish_reason == "error"
    assert bad.error.startswith(f"{stage} failed for this request: RuntimeError: poisoned")
    assert_all_blocks_free(llm.engine)
    engine = llm.engine
    assert metric(engine, "kvserve:request_success_total", finished_reason="error") == 1
    assert metric(engine, "kvserve:request_success_total", finished_reason="length") == 1


def _poisoned(method: str, args: tuple) -> bool:
    """Whether a call of the sampler's ``method`` involves the poisoned request."""
    if method == "_check":  # (params, prompt, output, vocab): one request
        return bool(args[0].extra.get("poison"))
    rows, params = args[0], args[3]  # _sample_rows: (rows, logits, uniform, params, ...)
    return any(params[i].extra.get("poison") for i in rows)


# _check: the per-request checks before the batch; _sample_rows: the batch itself, which falls
# back to one row at a time.
@pytest.mark.parametrize("method", ["_check", "_sample_rows"])
def test_a_sampler_failure_fails_only_its_request(
    tiny_llama_dir, canary_alone, monkeypatch, method
):
    original = getattr(Sampler, method)

    def failing(self, *args):
        if _poisoned(method, args):
            raise RuntimeError("poisoned row")
        return original(self, *args)

    monkeypatch.setattr(Sampler, method, failing)
    llm = make(tiny_llama_dir)
    outs = llm.generate([CANARY, OTHER], [greedy(), poisoned()])
    assert_failed_alone(llm, outs, canary_alone, "sampling")
    assert outs[1].outputs[0].token_ids == []


def test_a_failure_mid_generation_frees_the_blocks_it_held(
    tiny_llama_dir, canary_alone, monkeypatch
):
    original = Sampler._check

    def failing(self, p, prompt, output, vocab):
        if p.extra.get("poison") and len(output) == 3:
            raise RuntimeError("poisoned after three tokens")
        return original(self, p, prompt, output, vocab)

    monkeypatch.setattr(Sampler, "_check", failing)
    llm = make(tiny_llama_dir)
    outs = llm.generate([CANARY, OTHER], [greedy(), poisoned()])
    assert_failed_alone(llm, outs, canary_alone, "sampling")
    assert len(outs[1].outputs[0].token_ids) == 3


def test_a_post_processing_failure_fails_only_its_request(
    tiny_llama_dir, canary_alone, monkeypatch
):
    original = IncrementalDetokenizer.add

    def failing(self, token_ids):
        if self.params.extra.get("poison"):
            raise RuntimeError("poisoned text")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", failing)
    llm = make(tiny_llama_dir)
    outs = llm.generate([CANARY, OTHER], [greedy(), poisoned()])
    assert_failed_alone(llm, outs, canary_alone, "post-processing")


def test_a_failed_step_fails_its_requests_with_a_message_and_the_engine_goes_on(
    tiny_llama_dir, canary_alone, monkeypatch
):
    engine = make(tiny_llama_dir).engine
    engine.add_requests(
        [("a", engine.admit(CANARY, greedy()), 0), ("b", engine.admit(OTHER, greedy()), 0)]
    )
    engine.step()
    monkeypatch.setattr(engine.runner, "execute", lambda out: 1 / 0)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "error"
        assert o.outputs[0].error.startswith("the step failed for this request: ZeroDivisionError")
    assert_all_blocks_free(engine)
    monkeypatch.undo()
    engine.add_request("again", CANARY, greedy())
    tokens = []
    while engine.has_unfinished:
        tokens += [t for o in engine.step() for t in o.outputs[0].token_ids]
    assert tokens == canary_alone


# ---- admission: a group is queued whole or not at all ----


def group(engine: LLMEngine, name: str, sizes: list[int], **kw) -> list[tuple[str, Admitted, int]]:
    """Requests of ``sizes`` prompt tokens, each admitted (as the HTTP thread does)."""
    prompts = [random_prompt(n, VOCAB, i) for i, n in enumerate(sizes)]
    return [(f"{name}{i}", engine.admit(p, greedy(**kw)), 0) for i, p in enumerate(prompts)]


def queued(engine: LLMEngine) -> list[str]:
    return sorted(r.request_id for r in engine.scheduler.waiting)


def test_a_group_is_admitted_whole_or_not_at_all(tiny_llama_dir):
    engine = make(tiny_llama_dir, max_queue_len=4).engine
    engine.add_requests(group(engine, "a", [5, 6, 7]))
    assert queued(engine) == ["a0", "a1", "a2"]
    assert metric(engine, "kvserve:num_requests_waiting") == 3  # before any step
    with pytest.raises(QueueFullError) as e:
        engine.add_requests(group(engine, "b", [5, 5]))
    assert e.value.status == 429 and e.value.retry_after >= 1
    assert metric(engine, "kvserve:requests_rejected_total", reason="queue_full") == 1
    with pytest.raises(RequestError):  # a member refused at admission: the group never queues
        engine.add_requests(
            group(engine, "c", [5]) + group(engine, "c1", [9], stop_token_ids=[10**9])
        )
    assert queued(engine) == ["a0", "a1", "a2"]
    engine.check_admission(1)
    with pytest.raises(QueueFullError):
        engine.check_admission(2)
    assert metric(engine, "kvserve:requests_rejected_total", reason="queue_full") == 2
    assert queued(engine) == ["a0", "a1", "a2"]
    engine.abort("a2")
    assert metric(engine, "kvserve:num_requests_waiting") == 2  # before any step
    engine.add_requests(group(engine, "b", [5, 5]))  # the refused ids were never taken
    while engine.has_unfinished:
        engine.step()
    assert_all_blocks_free(engine)
    assert metric(engine, "kvserve:request_success_total", finished_reason="length") == 4


def test_queued_tokens_bound_a_group_by_its_total_prompt(tiny_llama_dir):
    engine = make(tiny_llama_dir, max_queued_tokens=30).engine
    engine.add_requests(group(engine, "a", [20]))
    with pytest.raises(QueueFullError):
        engine.add_requests(group(engine, "b", [6, 6]))  # 12 more: 32 queued tokens
    assert metric(engine, "kvserve:requests_rejected_total", reason="queued_tokens") == 1
    assert engine.scheduler.num_waiting_tokens == 20
    engine.check_admission(2, 10)
    engine.add_requests(group(engine, "b", [5, 5]))
    assert engine.scheduler.num_waiting_tokens == 30
    engine.step()
    assert engine.scheduler.num_waiting_tokens == 0
    assert metric(engine, "kvserve:num_requests_running") == 3


# ---- shift and sink end after max_overflow_tokens ----


@pytest.mark.parametrize("policy", ["shift", "sink"])
def test_shift_and_sink_stop_after_max_overflow_tokens(tiny_llama_dir, policy):
    bound = 40  # five discards of one block of 8
    llm = make(
        tiny_llama_dir, context_overflow=policy, context_n_discard=8, max_overflow_tokens=bound
    )
    prompt = random_prompt(10, VOCAB, 3)
    (out,) = llm.generate([prompt], greedy(10**9))
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt) + len(out.outputs[0].token_ids) == LIMIT + bound
    assert metric(llm.engine, "kvserve:context_overflows_total", policy=policy) == 6
    assert_all_blocks_free(llm.engine)


def test_max_overflow_tokens_is_a_positive_engine_flag():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--max-overflow-tokens", "7"])
    assert from_cli_args(ns).max_overflow_tokens == 7
    assert EngineArgs(model="m").max_overflow_tokens == 16384
    with pytest.raises(ValueError, match="max_overflow_tokens"):
        EngineArgs(model="m", max_overflow_tokens=0)
