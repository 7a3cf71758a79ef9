"""Overflow policies over HTTP: a pool far too small for a burst, a bounded queue, /metrics, and
the per-request ``overflow`` and ``priority`` body fields, with SmolLM2 behind uvicorn."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.args import EngineArgs
from tests.helpers import serve_in_thread

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_MODEL_LEN = 128
MAX_TOKENS = 32
QUEUE = 6


@pytest.fixture(scope="module")
def served(smollm2_dir, one_thread):
    """A pool of 8 blocks of 16: three requests of ~45 tokens fill it."""
    from engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.args import ServerArgs

    args = EngineArgs(
        model=str(smollm2_dir),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=8,
        block_size=16,
        max_num_seqs=8,
        preemption_mode="swap",
        swap_space_gib=0.02,  # ~28 blocks: swaps, and falls back to recompute when full
        max_queue_len=QUEUE,
    )
    engine = AsyncEngine(args)
    try:
        with serve_in_thread(build_app(engine, ServerArgs(served_model_name="smollm2"))) as url:
            yield engine, url
    finally:
        engine.shutdown()


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def completion(prompt: str, **extra) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
    body["ignore_eos"] = True
    return {**body, **extra}


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


async def burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_a_burst_on_a_tiny_pool_finishes_or_429s_every_request(served):
    engine, url = served
    before = scrape(url)
    prompts = [f"Write a short note number {i} about the weather in a new city." for i in range(20)]
    responses = asyncio.run(burst(url, [completion(p) for p in prompts]))

    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == len(responses), [r.text for r in responses]
    assert len(ok) >= QUEUE and refused
    for r in ok:
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"

    after = scrape(url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    preempted = grew("kvserve:num_preemptions_total{mode=swap}") + grew(
        "kvserve:num_preemptions_total{mode=recompute}"
    )
    assert preempted > 0
    assert grew("kvserve:requests_rejected_total{reason=queue_full}") == len(refused)
    assert grew("kvserve:request_success_total{finished_reason=length}") == len(ok)
    assert grew("kvserve:generation_tokens_total") == MAX_TOKENS * len(ok)
    assert after["kvserve:num_requests_running"] == after["kvserve:num_requests_waiting"] == 0
    assert after["kvserve:kv_cache_usage_perc{group=0}"] == 0
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    assert stats["swap_free_blocks"] == stats["swap_total_blocks"]
    assert 'num_gpu_blocks="8"' in httpx.get(f"{url}/metrics").text


def test_a_request_chooses_its_context_policy(served):
    _, url = served
    prompt = "Tell me everything you know about the history of bread. " * 8
    too_long = completion(prompt, max_tokens=MAX_MODEL_LEN)
    r = post(url, too_long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

    r = post(url, {**too_long, "overflow": {"policy": "stop"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_MODEL_LEN

    shifted = {**too_long, "overflow": {"policy": "shift", "n_keep": 8}, "priority": -1}
    r = post(url, shifted)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN

    r = post(url, {**too_long, "overflow": {"policy": "rewind"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("overflow")


@pytest.mark.parametrize(
    ("overflow", "param"),
    [
        ({"policy": "sink", "window": 16}, "overflow.window"),  # a setting sink does not read
        ({"policy": "shift", "kv_budget": 64}, "overflow.kv_budget"),
        ({"policy": "truncate", "n_discard": 16}, "overflow.n_discard"),
        ({"policy": "shift", "n_discard": 10**12}, "overflow.n_discard"),  # over the context
        ({"policy": "shift", "n_discard": MAX_MODEL_LEN}, "overflow.n_discard"),
    ],
)
def test_an_overflow_setting_that_cannot_apply_is_refused_by_name(served, overflow, param):
    _, url = served
    r = post(url, completion("Hello", overflow=overflow))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)


def test_overflow_field_is_in_the_openapi_schema(served):
    _, url = served
    schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    fields = {"policy", "n_keep", "n_discard", "kv_budget", "window", "selection"}
    assert set(schema["OverflowOptions"]["properties"]) == fields
    assert "overflow" in schema["CompletionRequest"]["properties"]
    assert "priority" in schema["ChatCompletionRequest"]["properties"]
