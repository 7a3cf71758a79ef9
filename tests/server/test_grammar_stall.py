"""A JSON schema that takes llguidance seconds to compile is compiled off the event loop, once:
other streams and /health go on meanwhile, and past --max-grammar-compile-s it gets a 400."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.test_hardening import metric
from tests.server.test_server import SERVED_NAME

REJECTED = "kvserve:requests_rejected_total"


def slow_schema(n: int, tag: str) -> dict:
    """``n`` required properties, half with patterns, half with ranges: llguidance compiles it
    in ~0.1 ms a property, while its JSON stays under 1 MiB (10000 properties: ~700 KiB, 1-2 s
    here). ``tag`` keeps each test's schema distinct, so none is compiled already."""
    properties = {
        f"{tag}{i}": (
            {"type": "string", "pattern": f"^([a-z]{{1,{i % 5 + 2}}}[0-9]){{1,3}}x{i}$"}
            if i % 2
            else {"type": "integer", "minimum": i, "maximum": i * 37 + 1000}
        )
        for i in range(n)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def constrained(url: str, schema: dict) -> httpx.Response:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Fill it in."}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_a_slow_schema_stalls_neither_other_streams_nor_health(served):
    _, url = served
    schema = slow_schema(10000, "p")
    arrivals: list[float] = []

    def canary() -> None:
        body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    if stop.is_set():
                        break

    stop = threading.Event()
    stream = threading.Thread(target=canary)
    stream.start()
    try:
        while len(arrivals) < 5:  # streaming steadily before the schema comes
            time.sleep(0.01)
        start = time.perf_counter()
        admission = threading.Thread(target=lambda: result.append(constrained(url, schema)))
        result: list[httpx.Response] = []
        admission.start()
        health = []
        while admission.is_alive():
            t = time.perf_counter()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.05)
        end = time.perf_counter()
    finally:
        stop.set()
        stream.join()
    assert result[0].status_code == 200, result[0].text
    assert end - start > 0.5  # the schema was slow: the old server stalled as long as this
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end]
    assert during and max(during) < 1.0, (max(during), end - start)
    assert max(health) < 1.0


def test_a_schema_slower_than_the_limit_gets_400_and_so_does_its_retry(served):
    engine, url = served
    schema = slow_schema(3000, "q")  # ~0.3 s to compile, against a limit of 0.05 s
    limit = engine.engine.max_grammar_compile_s
    engine.engine.max_grammar_compile_s = 0.05
    refused = metric(url, REJECTED, reason="grammar_too_complex")
    try:
        for _ in range(2):  # the retry waits on the same compile, or finds it cached and slow
            start = time.perf_counter()
            r = constrained(url, schema)
            assert time.perf_counter() - start < 5
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "grammar_too_complex"
            assert error["param"] == "response_format"
            assert error["type"] == "invalid_request_error"
            assert "--max-grammar-compile-s" in error["message"]
    finally:
        engine.engine.max_grammar_compile_s = limit
    assert metric(url, REJECTED, reason="grammar_too_complex") == refused + 2
    # Within the limit, the same server still takes a small schema.
    assert constrained(url, {"type": "object", "properties": {"a": {"type": "integer"}}}).is_success
