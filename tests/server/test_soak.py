"""Sustained mixed load with clients that walk away, then a schema fuzzer: afterwards every KV
block is back in the pool, /metrics adds up, and no request ever got a 5xx."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import httpx
import pytest

from tests.server.test_hardening import metric, server
from tests.server.test_server_errors import wait_for_free_blocks

VOCAB = 128  # the tiny model's
NUM_REQUESTS = 300
CONCURRENCY = 8


def random_body(rng: random.Random) -> dict:
    body = {
        "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))],
        "max_tokens": rng.randint(1, 40),
        "n": rng.choice((1, 1, 1, 2, 3)),
        "temperature": rng.choice((0, 0.7, 1.0)),
        "seed": rng.randrange(2**31),
        "ignore_eos": True,
        "stream": rng.random() < 0.6,
        "logprobs": 0,
    }
    if rng.random() < 0.15:
        body["overflow"] = {"policy": rng.choice(("shift", "sink", "truncate", "stop"))}
        body["max_tokens"] = rng.randint(150, 400)
    if rng.random() < 0.1:  # a bad value now and then: refused, counted nowhere
        body["stop_token_ids"] = [VOCAB + rng.randrange(5)]
    return body


async def one(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    body = random_body(rng)
    abort_after = rng.randint(1, 5) if rng.random() < 0.3 else None
    if not body["stream"]:
        try:
            r = await client.post("/v1/completions", json=body, timeout=rng.choice((0.05, 60)))
        except httpx.TimeoutException:  # the client gave up; the server was admitting it
            tally["gave_up"] += 1
            return
        tally[r.status_code] += 1
        if r.status_code == 200:
            tally["sequences"] += body["n"]
            tally["tokens"] += r.json()["usage"]["completion_tokens"]
        return
    async with client.stream("POST", "/v1/completions", json=body, timeout=60) as r:
        tally[r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            return
        tally["sequences"] += body["n"]
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                chunks += 1
                tally["tokens"] += sum(len(c["logprobs"]["tokens"]) for c in event["choices"])
                if chunks == abort_after:
                    tally["aborted"] += 1
                    return  # leaving the block closes the connection mid-stream


async def soak(url: str) -> dict:
    tally: dict = defaultdict(int, {200: 0, 400: 0, "sequences": 0, "tokens": 0})
    rng = random.Random(0)
    jobs = iter(range(NUM_REQUESTS))

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in jobs:
            await one(client, rng, tally)

    async with httpx.AsyncClient(base_url=url) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return tally


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    engine = dict(num_kv_blocks=48, max_num_seqs=8, max_model_len=256, block_size=16)
    with server(tiny_llama_dir, engine, {}) as pair:
        yield pair


def test_soak_with_client_aborts_leaves_every_block_free_and_metrics_consistent(tiny, one_thread):
    engine, url = tiny
    tally = asyncio.run(soak(url))
    assert set(tally) <= {200, 400, "sequences", "tokens", "aborted", "gave_up"}, dict(tally)
    assert tally[200] + tally[400] + tally["gave_up"] == NUM_REQUESTS
    assert tally["aborted"] > 10 and tally[400] > 5 and tally[200] > 200
    stats = wait_for_free_blocks(engine, timeout=30)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    assert stats["running"] == stats["waiting"] == stats["swapped"] == 0
    assert metric(url, "kvserve:num_requests_running") == 0
    assert metric(url, "kvserve:num_requests_waiting") == 0
    assert metric(url, "kvserve:kv_cache_usage_perc", group="0") == 0
    # Every admitted sequence finished exactly once, whatever ended it.
    finished = metric(url, "kvserve:e2e_request_latency_seconds_count")
    success = sum(
        metric(url, "kvserve:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    )
    assert metric(url, "kvserve:request_success_total", finished_reason="error") == 0
    # Requests a client gave up on before they were admitted never reached the engine.
    assert tally["sequences"] <= success == finished <= tally["sequences"] + 3 * tally["gave_up"]
    assert metric(url, "kvserve:generation_tokens_total") >= tally["tokens"]


# Generated requests per endpoint and mode (valid by the schema, and not).
FUZZ_EXAMPLES = 30
FUZZ_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def bounded(body):
    """Keeps a generated request cheap to serve; every other value is left as generated."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = min(body[name], 2)
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)
    return body


def test_schema_fuzzing_gets_no_server_error(tiny_llama_dir, one_thread):
    """The tiny model (token-id prompts; text gets a 400 from its missing tokenizer) keeps the
    run short; the values under test are the sampling ones, which every model shares."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    engine = dict(num_kv_blocks=64, max_num_seqs=8)
    failures = []
    with server(tiny_llama_dir, engine, {}) as (async_engine, url):
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        for path in FUZZ_PATHS:
            operation = schema[path]["POST"]
            for mode in schemathesis.GenerationMode:

                @given(case=operation.as_strategy(mode))
                @settings(
                    max_examples=FUZZ_EXAMPLES,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                def call(case) -> None:
                    case.body = bounded(case.body)
                    r = case.call(base_url=url, timeout=60)
                    if r.status_code >= 500:
                        failures.append((case.path, case.body, r.status_code, r.text[:300]))

                call()
        stats = wait_for_free_blocks(async_engine, timeout=30)
    assert not failures, failures[:5]
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
