"""The engine's side of the overflow policies with a tiny random Llama: admission by context
policy, per-request overrides, truncation, a bounded queue, a pool far too small for the load,
and the metrics that count all of it."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from engine import LLM, SamplingParams
from engine.core.context_overflow import ContextOverflow, Drop, TruncatePolicy
from engine.core.errors import QueueFullError, RequestError
from engine.llm_engine import LLMEngine
from tests.helpers import random_prompt, save_tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
LIMIT = 64


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, vocab_size=VOCAB, max_position_embeddings=512)
    return path


def make(path, **kw) -> LLM:
    args = dict(max_model_len=LIMIT, num_kv_blocks=16, block_size=8, device="cpu")
    return LLM(str(path), dtype="float32", **{**args, **kw})


def greedy(n: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return random_prompt(n, VOCAB, seed)


def metric(engine: LLMEngine, name: str, **labels) -> float:
    value = engine.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_error_policy_refuses_an_overlong_request_before_any_work(tiny_llama):
    llm = make(tiny_llama)
    with pytest.raises(RequestError) as e:
        llm.generate([prompt_of(40)], greedy(30))
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert not llm.engine.has_unfinished
    assert metric(llm.engine, "kvserve:requests_rejected_total", reason="context_length_exceeded")
    assert metric(llm.engine, "kvserve:context_overflows_total", policy="error") == 1


def test_a_request_overrides_the_default_policy(tiny_llama):
    llm = make(tiny_llama)
    stop = greedy(100, overflow=ContextOverflow("stop"))
    (out,) = llm.generate([prompt_of(40)], stop)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 24
    assert metric(llm.engine, "kvserve:context_overflows_total", policy="stop") == 1


def test_truncate_serves_the_first_n_keep_and_the_latest_prompt_tokens(tiny_llama):
    llm = make(tiny_llama, context_overflow="truncate", context_n_keep=5)
    prompt = prompt_of(100)
    (out,) = llm.generate([prompt], greedy(8))
    kept = prompt[:5] + prompt[100 - (LIMIT - 8 - 5) :]
    assert len(kept) == LIMIT - 8
    (same,) = make(tiny_llama).generate([kept], greedy(8))
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert metric(llm.engine, "kvserve:context_overflows_total", policy="truncate") == 1
    assert metric(llm.engine, "kvserve:prompt_tokens_total") == LIMIT - 8


def test_an_admitted_request_is_queued_as_decided_not_decided_again(tiny_llama, monkeypatch):
    llm = make(tiny_llama, context_overflow="truncate", context_n_keep=5)
    engine, prompt = llm.engine, prompt_of(100)
    admitted = engine.admit(prompt, greedy(8))
    assert admitted.policy == TruncatePolicy(5) and admitted.drop == Drop(5, 100 - (LIMIT - 8))

    def decided_again(*args):
        raise AssertionError("admission decided again on the engine thread")

    monkeypatch.setattr(engine, "admit", decided_again)
    monkeypatch.setattr(TruncatePolicy, "admit", decided_again)
    engine.add_requests([("a", admitted, 0)])
    req = engine.scheduler.requests["a"]
    assert req.token_ids == prompt[:5] + prompt[100 - (LIMIT - 8 - 5) :]
    assert req.context_policy is admitted.policy and req.prompt_token_ids == prompt
    while engine.has_unfinished:
        engine.step()
    assert metric(engine, "kvserve:context_overflows_total", policy="truncate") == 1


def test_shift_is_refused_for_a_model_that_cannot_rotate_its_cache(tiny_llama):
    llm = make(tiny_llama)
    llm.engine.runner.key_rope = None
    with pytest.raises(RequestError) as e:
        llm.generate([prompt_of(10)], greedy(100, overflow=ContextOverflow("shift")))
    assert e.value.param == "overflow"


def test_a_full_queue_refuses_with_a_retry_after(tiny_llama):
    llm = make(tiny_llama, max_queue_len=2)
    engine = llm.engine
    engine.add_request("a", prompt_of(10), greedy(4))
    engine.add_request("b", prompt_of(10), greedy(4))
    with pytest.raises(QueueFullError) as e:
        engine.add_request("c", prompt_of(10), greedy(4))
    assert e.value.status == 429 and e.value.retry_after >= 1
    assert metric(engine, "kvserve:requests_rejected_total", reason="queue_full") == 1
    engine.step()  # both start running: the queue has room again
    engine.add_request("c", prompt_of(10), greedy(4))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_far_too_small_still_finishes_every_request(tiny_llama, mode):
    # 12 requests of up to 61 tokens would hold 8 blocks of 8 each; the pool has 12.
    llm = make(tiny_llama, num_kv_blocks=12, preemption_mode=mode, swap_space_gib=0.001)
    prompts = [prompt_of(8 + 2 * i, seed=i) for i in range(12)]
    params = [greedy(20 + i) for i in range(12)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20 + i for i in range(12)]
    for prompt, p, out in zip(prompts[:3], params, outs):  # spot-check against running alone
        (alone,) = make(tiny_llama).generate([prompt], p)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.kv.num_free_host_blocks == engine.kv.num_total_host_blocks
    text = generate_latest(engine.metrics.registry).decode()
    assert f'kvserve:num_preemptions_total{{mode="{mode}"}}' in text
    assert metric(engine, "kvserve:num_preemptions_total", mode=mode) > 0
    assert metric(engine, "kvserve:request_success_total", finished_reason="length") == 12
    assert metric(engine, "kvserve:generation_tokens_total") == sum(20 + i for i in range(12))
    assert metric(engine, "kvserve:num_requests_running") == 0
    assert metric(engine, "kvserve:kv_cache_usage_perc", group="0") == 0
    if mode == "swap":
        assert metric(engine, "kvserve:swapped_blocks_total", direction="out") > 0


def test_metrics_carry_the_vllm_style_names_and_the_cache_layout(tiny_llama):
    llm = make(tiny_llama)
    llm.generate([prompt_of(10)], greedy(5))
    text = generate_latest(llm.engine.metrics.registry).decode()
    for name in [
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:num_requests_swapped",
        'kvserve:kv_cache_usage_perc{group="0"}',
        "kvserve:prompt_tokens_total 10.0",
        "kvserve:generation_tokens_total 5.0",
        'kvserve:request_success_total{finished_reason="length"} 1.0',
        "kvserve:time_to_first_token_seconds_count 1.0",
        "kvserve:inter_token_latency_seconds_count 4.0",
        "kvserve:e2e_request_latency_seconds_count 1.0",
        "kvserve:request_queue_time_seconds_count 1.0",
        "kvserve:num_preemptions_total",
        "kvserve:context_overflows_total",
        "kvserve:swapped_blocks_total",
        "kvserve:requests_rejected_total",
        'kvserve:cache_config_info{block_size="8"',
    ]:
        assert name in text, name
    # One registry per engine: a second engine starts from zero.
    assert metric(make(tiny_llama).engine, "kvserve:generation_tokens_total") == 0
