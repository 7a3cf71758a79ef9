"""`kvserve bench` against a fake OpenAI-compatible server whose timing and tokens are known."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from bench.cli import main
from bench.loadtest import (
    SLO,
    BenchConfig,
    BenchError,
    PromptCalibration,
    RequestRecord,
    arrival_times,
    format_summary,
    is_loopback_url,
    latency_stats,
    parse_metrics,
    run_benchmark,
    summarize,
    synthetic_requests,
)
from tests.helpers import serve_in_thread

MODEL = "fake-model"


@dataclass
class Fake:
    """What the fake server does; every reply is a deterministic function of the request."""

    first_token_delay: float = 0.03
    token_delay: float = 0.004
    eos_after: int = 3  # tokens generated when the request does not ask for ignore_eos
    fail_every: int = 0  # the k-th, 2k-th... request fails, with fail_statuses in turn
    fail_statuses: tuple[int, ...] = (429,)
    send_usage: bool = True
    tokens_per_word: int = 1  # its "tokenizer": whitespace words, each this many tokens
    chat_overhead: int = 0  # tokens its "chat template" adds around the messages
    tokenize: bool = False  # expose /tokenize (vLLM's shape)
    prefix_cache: bool = False  # report the words shared with an earlier prompt as cached
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: set[str | None] = field(default_factory=set)
    running: int = 0


def _prompt_tokens(fake: Fake, body: dict[str, Any]) -> int:
    if "messages" in body:
        words = sum(len(m["content"].split()) for m in body["messages"])
        return words * fake.tokens_per_word + fake.chat_overhead
    return len(body["prompt"].split()) * fake.tokens_per_word


def _words_of(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        return [w for m in body["messages"] for w in m["content"].split()]
    return body["prompt"].split()


def _cached_words(bodies: list[dict[str, Any]]) -> int:
    """Words of the last prompt that an earlier prompt started with."""
    new, best = _words_of(bodies[-1]), 0
    for body in bodies[:-1]:
        old = _words_of(body)
        n = next((i for i, (a, b) in enumerate(zip(new, old)) if a != b), min(len(new), len(old)))
        best = max(best, n)
    return best


def fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        usage = min(1.0, fake.running / 8)
        return PlainTextResponse(
            "# TYPE kvserve:num_requests_running gauge\n"
            f"kvserve:num_requests_running {fake.running}\n"
            "# TYPE kvserve:num_requests_waiting gauge\n"
            "kvserve:num_requests_waiting 0\n"
            "# TYPE kvserve:kv_cache_usage_perc gauge\n"
            f'kvserve:kv_cache_usage_perc{{group="full"}} {usage}\n'
            f'kvserve:kv_cache_usage_perc{{group="sliding"}} {usage / 2}\n'
            "# TYPE kvserve:requests counter\n"
            f"kvserve:requests_total {len(fake.bodies)}\n"
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        if not fake.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        return JSONResponse({"count": _prompt_tokens(fake, body)})

    async def generate(request: Request, chat: bool) -> Any:
        body = await request.json()
        fake.bodies.append(body)
        fake.auth.add(request.headers.get("authorization"))
        n = len(fake.bodies)
        if fake.fail_every and n % fake.fail_every == 0:
            status = fake.fail_statuses[(n // fake.fail_every - 1) % len(fake.fail_statuses)]
            headers = {"Retry-After": "1"} if status == 429 else {}
            error = {"error": {"message": f"fake failure {status}", "code": status}}
            return JSONResponse(error, status_code=status, headers=headers)
        n_out = (
            body["max_tokens"]
            if body.get("ignore_eos")
            else min(body["max_tokens"], fake.eos_after)
        )
        usage = {"prompt_tokens": _prompt_tokens(fake, body), "completion_tokens": n_out}
        if fake.prefix_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": _cached_words(fake.bodies)}
        if not body.get("stream"):
            await asyncio.sleep(fake.first_token_delay + fake.token_delay * (n_out - 1))
            text = "tok " * n_out
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return {"choices": [choice], "usage": usage}
        want_usage = fake.send_usage and body.get("stream_options", {}).get("include_usage")
        return StreamingResponse(_stream(fake, chat, n_out, usage if want_usage else None))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = await request.json()
        fake.bodies.append(body)
        n_out = body["max_output_tokens"]
        usage = {"input_tokens": _prompt_tokens(fake, {"messages": body["input"]}),
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out}  # fmt: skip
        if not body.get("stream"):
            text = {"type": "output_text", "text": "tok " * n_out}
            return {"output": [{"type": "message", "content": [text]}], "usage": usage}
        return StreamingResponse(_response_events(fake, n_out, usage))

    return app


async def _response_events(fake: Fake, n_out: int, usage: dict) -> Any:
    """The Responses API's typed events: no token before the first text delta."""

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    yield event("response.created", response={"usage": None})
    yield event("response.output_item.added", item={"type": "message", "content": []})
    await asyncio.sleep(fake.first_token_delay)
    for i in range(n_out):
        if i:
            await asyncio.sleep(fake.token_delay)
        yield event("response.output_text.delta", delta="tok ")
    yield event("response.output_text.done", text="tok " * n_out)
    yield event("response.completed", response={"usage": usage})


async def _stream(fake: Fake, chat: bool, n_out: int, usage: dict | None) -> Any:
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    fake.running += 1
    try:
        if chat:  # role-only first delta, as vLLM sends: it carries no token
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(fake.first_token_delay)
        for i in range(n_out):
            if i:
                await asyncio.sleep(fake.token_delay)
            part = {"delta": {"content": "tok "}} if chat else {"text": "tok "}
            yield event({"choices": [{"index": 0, **part, "finish_reason": None}]})
        if usage is not None:
            yield event({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        fake.running -= 1


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on a free loopback port; yields its base URL (with /v1)."""
    with serve_in_thread(app, lifespan="off") as url:
        yield f"{url}/v1"


def serve(fake: Fake):
    return serve_app(fake_app(fake))


def bench(base_url: str, **overrides: Any):
    config = BenchConfig(base_url=base_url, **{"scrape_interval_s": 0.05, **overrides})
    return asyncio.run(run_benchmark(config))


# --- statistics and workload, no server ---------------------------------------------------


def test_latency_stats_percentiles_match_numpy():
    ramp = latency_stats([i / 1e3 for i in range(1, 101)])  # 1..100 ms
    assert ramp.count == 100
    assert ramp.mean_ms == pytest.approx(50.5)
    assert ramp.median_ms == pytest.approx(50.5)
    assert ramp.p90_ms == pytest.approx(90.1)
    assert ramp.p99_ms == pytest.approx(99.01)

    samples = np.random.default_rng(7).lognormal(mean=-3, sigma=1, size=333)
    stats = latency_stats(samples.tolist())
    ms = samples * 1e3
    assert stats.mean_ms == pytest.approx(ms.mean())
    assert stats.median_ms == pytest.approx(np.median(ms))
    assert stats.p90_ms == pytest.approx(np.percentile(ms, 90))
    assert stats.p99_ms == pytest.approx(np.percentile(ms, 99))

    assert latency_stats([]).p99_ms is None


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_arrivals_have_mean_gap_one_over_rate_and_gamma_spread(burstiness):
    rate = 4.0
    times = arrival_times(20_000, rate, burstiness, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # A gamma of shape B has coefficient of variation 1/sqrt(B): 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    again = arrival_times(20_000, rate, burstiness, np.random.default_rng(0))
    assert np.array_equal(times, again)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_times(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))


def test_synthetic_prompts_follow_length_ranges_and_differ():
    config = BenchConfig(
        num_prompts=200,
        input_len=100,
        input_len_range=0.5,
        output_len=40,
        output_len_range=0.25,
        prefix_len=10,
        seed=3,
    )
    reqs = synthetic_requests(config)
    words = [len(r.prompt.split()) for r in reqs]
    assert all(60 <= n <= 160 for n in words)  # 10 shared + 50..150
    assert all(30 <= r.max_tokens <= 50 for r in reqs)
    assert len({r.prompt for r in reqs}) == len(reqs)
    assert len({" ".join(r.prompt.split()[:10]) for r in reqs}) == 1
    assert reqs == synthetic_requests(config)
    halved = synthetic_requests(config, PromptCalibration(tokens_per_word=2.0))
    assert all(30 <= len(r.prompt.split()) <= 80 for r in halved)
    chat = dataclasses.replace(config, endpoint="chat", prefix_len=0, input_len_range=0.0)
    templated = synthetic_requests(chat, PromptCalibration(overhead_tokens=30))
    assert all(len(r.messages[0]["content"].split()) == 70 for r in templated)


def test_sessions_resend_their_history_and_a_fraction_shares_the_prefix():
    config = BenchConfig(
        num_prompts=9, input_len=6, output_len=4, turns=3, prefix_len=5, prefix_fraction=0.5,
        endpoint="chat", seed=2,
    )  # fmt: skip
    reqs = synthetic_requests(config)
    sessions = 3
    for i, r in enumerate(reqs):
        turn = i // sessions
        assert [m["role"] for m in r.messages] == ["user", "assistant"] * turn + ["user"]
        assert r.after == (i - sessions if turn else None)
        if turn:
            before = reqs[i - sessions].messages
            assert r.messages[: len(before)] == before
            assert len(r.messages[-2]["content"].split()) == reqs[i - sessions].max_tokens
    # Each session's own history ahead of its first question, after the shared prefix.
    own = synthetic_requests(dataclasses.replace(config, session_history=20, prefix_fraction=1))
    firsts = [r.messages[0]["content"].split() for r in own[:sessions]]
    assert all(len(words) == 5 + 20 + 6 for words in firsts)
    assert (
        len({" ".join(w[:5]) for w in firsts}) == 1
        and len({" ".join(w[5:25]) for w in firsts}) == 3
    )
    assert own[0].prompt_tokens_est == 5 + 20 + 6 and own[3].messages[0] == own[0].messages[0]
    many = synthetic_requests(dataclasses.replace(config, num_prompts=400, turns=1))
    heads = [" ".join(r.messages[0]["content"].split()[:5]) for r in many]
    shared = max(set(heads), key=heads.count)
    assert 150 < heads.count(shared) < 250


def test_sessions_run_turn_after_turn_and_report_the_hit_rate():
    fake = Fake(prefix_cache=True)
    with serve(fake) as url:
        result = bench(
            url, num_prompts=8, turns=4, input_len=5, output_len=3, endpoint="chat",
            max_concurrency=8,
        )  # fmt: skip
    s = result.summary
    assert s.completed == 8
    order = [len(b["messages"]) for b in fake.bodies]
    assert order[:2] == [1, 1] and order == sorted(order)  # a turn only after the one before
    recs = sorted(result.requests, key=lambda r: r.index)
    for r in recs[2:]:
        assert r.scheduled_s >= recs[r.index - 2].end_s
        assert r.cached_tokens > 0
    assert s.cached_input_tokens == sum(r.cached_tokens for r in recs)
    assert "Prefix cache hit rate (% of input):" in format_summary(result)


def _record(i: int, ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        index=i,
        scheduled_s=0.0,
        start_s=0.0,
        end_s=e2e,
        success=ok,
        ttft_s=ttft,
        output_tokens=tokens,
        prompt_tokens=10,
    )


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        _record(0, ttft=0.05, e2e=0.05 + 9 * 0.010, tokens=10),  # tpot 10 ms
        _record(1, ttft=0.20, e2e=0.20 + 9 * 0.010, tokens=10),  # ttft too slow
        _record(2, ttft=0.05, e2e=0.05 + 9 * 0.030, tokens=10),  # tpot too slow
        _record(3, ttft=0.05, e2e=0.05, tokens=1),  # no tpot: cannot miss it
        _record(4, ttft=0.01, e2e=0.02, tokens=2, ok=False),  # failed: never good
    ]
    records[4].failure = "500"
    slo = SLO.parse("ttft=100,tpot=20")
    assert slo == SLO(ttft_ms=100, tpot_ms=20)
    s = summarize(records, duration_s=2.0, slo=slo, planned=6)
    assert s.good_requests == 2 and s.goodput == pytest.approx(1.0)
    assert s.completed == 4 and s.failed == 1 and s.not_sent == 1
    assert s.failed_by_status == {"500": 1}
    assert s.tpot.count == 3 and s.tpot.median_ms == pytest.approx(10.0)
    assert s.output_throughput == pytest.approx((10 + 10 + 10 + 1) / 2.0)
    assert summarize(records, 2.0, SLO(e2e_ms=150), 5).good_requests == 2
    assert summarize(records, 2.0, SLO(), 5).goodput is None
    with pytest.raises(ValueError):
        SLO.parse("latency=5")


def test_parse_metrics_accepts_vllm_names_and_label_sets():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 2\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 3\n'
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="m"} 7\n'
        "# TYPE process_cpu_seconds counter\n"
        "process_cpu_seconds_total 1.5\n"
    )
    gauges, counters = parse_metrics(text)
    assert gauges["num_requests_running"] == 5
    assert gauges['num_requests_running{engine="1",model_name="m"}'] == 3
    assert gauges["kv_cache_usage_perc"] == pytest.approx(0.4)
    assert "num_requests_waiting" not in gauges
    assert counters == {'vllm:num_preemptions_total{model_name="m"}': 7.0}


def test_refuses_non_loopback_targets_without_resolving(capsys):
    for url in (
        "http://localhost:8000/v1",
        "http://127.0.0.9/v1",
        "http://[::1]:80/v1",
        "http://[::ffff:127.0.0.1]/v1",
    ):
        assert is_loopback_url(url), url
    for url in (
        "http://example.com/v1",
        "http://10.0.0.1/v1",
        "http://localhost.evil.test/v1",
        "http://127.0.0.1.nip.io/v1",
        "http://0.0.0.0/v1",
    ):
        assert not is_loopback_url(url), url
    with pytest.raises(BenchError, match="--allow-remote"):
        asyncio.run(run_benchmark(BenchConfig(base_url="http://example.invalid/v1")))
    assert main(["--base-url", "http://203.0.113.5:8000/v1", "--no-progress"]) == 2
    assert "not loopback" in capsys.readouterr().err


# --- against the fake server --------------------------------------------------------------


def test_streaming_run_measures_known_tokens_and_timing():
    fake = Fake()
    with serve(fake) as url:
        result = bench(url, num_prompts=12, max_concurrency=4, input_len=20, output_len=8)
    s = result.summary
    assert result.model == MODEL
    assert (s.completed, s.failed, s.failed_by_status) == (12, 0, {})
    for rec in result.requests:
        assert rec.usage_reported and rec.output_tokens == 8 and rec.prompt_tokens == 20
        assert len(rec.itl_s) == 7
        assert rec.ttft_s >= fake.first_token_delay
        # Chunks may arrive bunched, so only the whole stream is bounded by the fake's sleeps.
        assert rec.e2e_s >= fake.first_token_delay + 7 * fake.token_delay
        assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 7)
    assert s.total_output_tokens == 96 and s.total_input_tokens == 240
    assert s.output_throughput == pytest.approx(96 / s.duration_s)
    assert s.total_token_throughput == pytest.approx(336 / s.duration_s)
    assert s.ttft.count == 12 and s.itl.count == 84
    assert s.ttft.median_ms >= fake.first_token_delay * 1e3
    assert s.max_in_flight == 4
    # Three waves of four, each at least first-token delay + 7 token gaps long.
    assert s.duration_s >= 3 * (fake.first_token_delay + 7 * fake.token_delay)
    body = fake.bodies[0]
    assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}

    metrics = result.metrics
    assert len(metrics.t_s) >= 3
    assert max(metrics.values["num_requests_running"]) >= 1
    assert metrics.values["num_requests_running"][0] == 0  # the baseline before the load
    usage = metrics.values["kv_cache_usage_perc"]
    full = metrics.values['kv_cache_usage_perc{group="full"}']
    assert usage == full  # the fuller group is the one reported
    assert metrics.counter_deltas == {"kvserve:requests_total": 12.0}


def test_chat_without_usage_counts_content_chunks():
    fake = Fake(send_usage=False, eos_after=3)
    with serve(fake) as url:
        result = bench(url, endpoint="chat", num_prompts=4, output_len=16, ignore_eos=False)
    assert result.summary.completed == 4
    for rec in result.requests:
        assert not rec.usage_reported and rec.output_tokens == 3 and len(rec.itl_s) == 2
        assert rec.ttft_s >= fake.first_token_delay  # the role-only chunk is not a token
    assert all("ignore_eos" not in b and "messages" in b for b in fake.bodies)


def test_the_responses_endpoint_gets_conversations_and_its_events_are_timed(capsys):
    fake = Fake(tokens_per_word=2, chat_overhead=6, tokenize=True)
    with serve(fake) as url:
        streamed = bench(url, endpoint="responses", num_prompts=4, turns=2, input_len=20,
                         output_len=5)  # fmt: skip
        whole = bench(url, endpoint="responses", num_prompts=2, output_len=3, stream=False)
        argv = ["--base-url", url, "--endpoint", "responses", "--num-prompts", "2"]
        assert main([*argv, "--output-len", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+2\n", out), out
    assert len(fake.bodies) == 8 and all("input" in b for b in fake.bodies)
    assert streamed.summary.completed == 4 and whole.summary.completed == 2
    for rec in streamed.requests:
        assert rec.output_tokens == 5 and len(rec.itl_s) == 4 and rec.usage_reported
        assert rec.ttft_s >= fake.first_token_delay  # the created event is not a token
        assert rec.cached_tokens == 0
    assert [r.prompt_tokens for r in streamed.requests[:2]] == [20, 20]  # first turns
    assert [r.output_tokens for r in whole.requests] == [3, 3]
    first, _, second, *_ = fake.bodies
    assert first["store"] is False and first["max_output_tokens"] == 5 and first["ignore_eos"]
    assert [m["role"] for m in second["input"]] == ["user", "assistant", "user"]
    assert second["input"][0] == first["input"][0]


def test_failures_are_counted_by_status_and_goodput_uses_the_rest():
    fake = Fake(fail_every=3, fail_statuses=(429, 500))
    with serve(fake) as url:
        result = bench(
            url,
            num_prompts=9,
            max_concurrency=3,
            output_len=4,
            slo=SLO(ttft_ms=10_000, tpot_ms=10_000),
        )
    s = result.summary
    assert (s.completed, s.failed) == (6, 3)
    assert s.failed_by_status == {"429": 2, "500": 1}
    throttled = [r for r in result.requests if r.status == 429]
    assert len(throttled) == 2 and all(r.retry_after == "1" for r in throttled)
    assert all("fake failure" in r.error for r in result.requests if not r.success)
    assert s.good_requests == 6 and s.goodput == pytest.approx(6 / s.duration_s)
    assert s.total_output_tokens == 24


def test_request_rate_paces_arrivals_from_the_seeded_schedule():
    with serve(Fake(first_token_delay=0.001, token_delay=0.001)) as url:
        result = bench(url, num_prompts=10, request_rate=40.0, burstiness=2.0, seed=5, output_len=2)
    expected = arrival_times(10, 40.0, 2.0, np.random.default_rng([5, 1]))
    scheduled = [r.scheduled_s for r in result.requests]
    assert scheduled == pytest.approx(expected.tolist())
    for rec in result.requests:
        assert rec.start_s >= rec.scheduled_s
        assert rec.start_s - rec.scheduled_s < 0.1
    assert result.summary.duration_s >= expected[-1]


def test_duration_bound_cancels_what_still_runs():
    fake = Fake(token_delay=0.2)
    with serve(fake) as url:
        t = time.perf_counter()
        result = bench(url, num_prompts=4, max_concurrency=2, output_len=50, duration_s=0.5)
        elapsed = time.perf_counter() - t
    s = result.summary
    assert elapsed < 3.0 and s.duration_s < 1.0
    assert (s.completed, s.failed, s.cancelled) == (0, 0, 4)
    assert sum(r.start_s is None for r in result.requests) == 2  # still waiting for a slot


def test_tokenize_endpoint_calibrates_prompt_size():
    with serve(Fake(tokens_per_word=2, chat_overhead=6, tokenize=True)) as url:
        calibrated = bench(url, num_prompts=3, input_len=40, output_len=2)
        blind = bench(url, num_prompts=3, input_len=40, output_len=2, calibrate=False)
        chat = bench(url, num_prompts=3, input_len=40, output_len=2, endpoint="chat")
    # Two tokens per word: calibrated prompts shrink to 20 words, blind ones stay at 40 words.
    assert [r.prompt_tokens for r in calibrated.requests] == [40, 40, 40]
    assert [r.prompt_tokens for r in blind.requests] == [80, 80, 80]
    # The template's tokens come out of the budget: 17 words, 34 tokens, + 6.
    assert [r.prompt_tokens for r in chat.requests] == [40, 40, 40]


def test_dataset_lines_drive_prompts_and_max_tokens(tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "one two three", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "four five"}]},
    ]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fake = Fake()
    with serve(fake) as url:
        result = bench(url, endpoint="chat", dataset=str(dataset), num_prompts=3, output_len=7)
    assert [r.output_tokens for r in result.requests] == [5, 7, 5]
    assert [r.prompt_tokens for r in result.requests] == [3, 2, 3]
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": "one two three"}]


def test_non_streaming_requests_take_usage_from_the_reply():
    with serve(Fake()) as url:
        result = bench(url, num_prompts=3, output_len=6, stream=False)
    assert result.summary.completed == 3 and result.summary.total_output_tokens == 18
    assert all(r.ttft_s is None and r.itl_s == [] for r in result.requests)


def _strict_json(text: str) -> Any:
    def reject(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=reject)


def test_cli_prints_table_and_writes_json_and_plots(tmp_path, capsys):
    out_json, plot_dir = tmp_path / "run" / "result.json", tmp_path / "plots"
    fake = Fake()
    with serve(fake) as url:
        code = main(
            [
                "--base-url",
                url,
                "--num-prompts",
                "8",
                "--max-concurrency",
                "4",
                "--input-len",
                "16",
                "--output-len",
                "6",
                "--slo",
                "ttft=5000,tpot=5000",
                "--scrape-interval",
                "0.05",
                "--result-json",
                str(out_json),
                "--plot-dir",
                str(plot_dir),
                "--no-progress",
                "--api-key",
                "sk-test",
            ]
        )
    assert code == 0 and fake.auth == {"Bearer sk-test"}
    stdout = capsys.readouterr().out
    assert "Serving Benchmark Result" in stdout and "P99 TTFT (ms):" in stdout
    assert "Request goodput (req/s):" in stdout

    data = _strict_json(out_json.read_text())
    assert set(data) == {"config", "model", "started_at", "summary", "requests", "metrics"}
    assert data["config"]["request_rate"] is None  # unlimited, not Infinity
    assert data["config"]["api_key"] == "***"
    assert data["summary"]["completed"] == 8 and len(data["requests"]) == 8
    assert data["summary"]["ttft"]["p99_ms"] > 0
    assert data["requests"][0]["output_tokens"] == 6 and len(data["requests"][0]["itl_s"]) == 5
    assert "num_requests_running" in data["metrics"]["values"]

    for name in ("latency.png", "timeline.png"):
        png = (plot_dir / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name


# --- against the real server --------------------------------------------------------------


@pytest.mark.slow
def test_real_server_completes_a_short_benchmark(smollm2_dir):
    from engine.args import EngineArgs
    from engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.args import ServerArgs

    args = EngineArgs(
        model=str(smollm2_dir), device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=4
    )
    engine = AsyncEngine(args)
    try:
        app = build_app(engine, ServerArgs(served_model_name="smollm2"))
        with serve_app(app) as url:
            result = bench(
                url,
                num_prompts=6,
                max_concurrency=3,
                input_len=32,
                output_len=8,
                scrape_interval_s=0.1,
            )
    finally:
        engine.shutdown()
    s = result.summary
    assert result.model == "smollm2"
    assert (s.completed, s.failed, s.cancelled) == (6, 0, 0), result.requests[0].error
    for rec in result.requests:
        assert rec.usage_reported and rec.output_tokens == 8 and len(rec.itl_s) >= 1
        assert 24 <= rec.prompt_tokens <= 40  # sized by the server's /tokenize
    if "/metrics" not in {getattr(route, "path", None) for route in app.routes}:
        pytest.skip("the server exports no /metrics yet")
    assert result.metrics.t_s and "num_requests_running" in result.metrics.values
    assert max(v or 0 for v in result.metrics.values["num_requests_running"]) >= 1


def test_a_session_workload_reports_each_turn_apart():
    """Three sessions of two turns: requests 0-2 are first turns, 3-5 second ones (whose
    prompts the prefix cache partly served); one of them failed."""
    records = [_record(i, ttft=0.1 * (1 + i // 3), e2e=1.0, tokens=4) for i in range(6)]
    for r in records[3:]:
        r.prompt_tokens, r.cached_tokens = 20, 15
    records[5].success = False
    s = summarize(records, 2.0, SLO(), planned=6, turns=2)
    first, second = s.by_turn
    assert (first.turn, first.completed, second.turn, second.completed) == (1, 3, 2, 2)
    assert first.ttft.median_ms == pytest.approx(100) and second.ttft.median_ms == pytest.approx(
        200
    )
    assert first.cached_fraction is None and second.cached_fraction == pytest.approx(0.75)
    assert summarize(records, 2.0, SLO(), planned=6).by_turn == ()
