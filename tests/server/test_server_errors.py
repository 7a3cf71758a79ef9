"""Bad input gets an OpenAI-shaped error with the right status, and disturbs no one else."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from engine.core.context_overflow import StopPolicy
from engine.core.errors import QueueFullError
from engine.llm_engine import Admitted
from tests.server.test_server import MAX_MODEL_LEN, real_server

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (path, body, status, param): the param the error must name.
BAD_REQUESTS = [
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -3}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),  # fmt: skip
    (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        "tool_choice",
    ),  # fmt: skip
    (CHAT, {"messages": [{"role": "assistant"}]}, 400, "messages.0.content"),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (
        CHAT,
        {
            "messages": MSG,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        400,
        "response_format",
    ),  # fmt: skip
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"regex": "(ab"}},
        400,
        "structured_outputs",
    ),
    (
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
    ),  # fmt: skip
    (
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"json": "{not json"}},
        400,
        "structured_outputs",
    ),  # fmt: skip
    (COMPLETIONS, {"prompt": "Hi", "grammar": "root ::= foo"}, 400, "grammar"),
    (
        COMPLETIONS,
        {"prompt": "Hi", "grammar": 'root ::= "a"', "json_schema": {}},
        400,
        "json_schema",
    ),  # fmt: skip
    (CHAT, {"messages": MSG, "logit_bias": {"49152": 10}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"42": 101}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"42": "up"}}, 400, "logit_bias.42"),
    (CHAT, {"messages": MSG, "temprature": 0.5}, 400, "temprature"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        400,
        "tool_calls",
    ),  # fmt: skip
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "Hi"}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "n": 1000}, 400, "n"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "Hi", "messages": MSG}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- the wire format alone, over a stub engine ----


class StubEngine:
    """Only what the app touches before generating; ``fail_with`` is raised by generate."""

    model_name = "stub"
    max_model_len = 64
    tokenizer = SimpleNamespace(
        has_chat_template=True,
        template_takes_tools=False,
        encode_chat=lambda messages, gen=True, tools=None, max_tokens=None: [1, 2, 3],
    )

    def __init__(self, fail_with: Exception):
        self.fail_with = fail_with
        self.admitted: list[Admitted] = []  # what admit decided
        self.submitted: list = []  # the engine requests submit was given

    def admit(self, prompt_token_ids, params) -> Admitted:
        self.admitted.append(Admitted(tuple(prompt_token_ids), params, StopPolicy()))
        return self.admitted[-1]

    def check_admission(self, num_requests, num_tokens=0) -> None:
        pass

    def submit(self, requests):
        self.submitted += requests

        async def failing():
            raise self.fail_with
            yield  # pragma: no cover

        return [failing() for _ in requests]

    def abort(self, request_id) -> None:
        pass


def stub_post(fail_with: Exception | StubEngine, body: dict | None = None) -> httpx.Response:
    from server.app import build_app

    engine = fail_with if isinstance(fail_with, StubEngine) else StubEngine(fail_with)
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as c:
            return await c.post(CHAT, json=body or {"messages": MSG})

    return asyncio.run(post())


def test_a_prompt_is_admitted_once_and_every_choice_carries_the_decision():
    engine = StubEngine(RuntimeError("stop here"))
    stub_post(engine, {"messages": MSG, "n": 3, "seed": 7})
    (decided,) = engine.admitted
    assert decided.prompt_token_ids == (1, 2, 3)
    carried = [r.admitted for r in engine.submitted]
    assert [a.params.seed for a in carried] == [7, 8, 9]  # each choice its own params
    for a in carried:
        assert a.policy is decided.policy and a.drop is decided.drop
        assert a.prompt_token_ids == decided.prompt_token_ids


def test_queue_full_is_429_with_retry_after():
    r = stub_post(QueueFullError("The server is busy.", retry_after=2.5))
    error = assert_error(r, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert r.headers["Retry-After"] == "3"


def test_unexpected_error_is_an_openai_shaped_500():
    error = assert_error(stub_post(RuntimeError("boom")), 500)
    assert "boom" in error["message"]


# ---- the real server ----


@pytest.fixture(scope="module")
def served(smollm2_dir):
    with real_server(smollm2_dir) as pair:
        yield pair


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[1]


def tokens_of(served, text: str) -> int:
    """From the served engine's tokenizer: /tokenize counts no further than max_model_len."""
    return len(served[0].tokenizer.encode(text))


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_openai_error(url, path, body, status, param):
    assert_error(httpx.post(url + path, json=body), status, param)


@pytest.mark.slow
def test_unknown_model_message_names_it(url):
    r = httpx.post(url + CHAT, json={"model": "nope", "messages": MSG})
    error = assert_error(r, 404, "model")
    assert error["message"] == "The model `nope` does not exist."
    assert error["code"] == "model_not_found"


@pytest.mark.slow
def test_unsupported_and_unknown_fields_are_named_in_the_message(url):
    r = httpx.post(url + CHAT, json={"messages": MSG, "functions": [{"name": "f"}]})
    assert "`functions` is not supported" in assert_error(r, 400)["message"]
    r = httpx.post(url + CHAT, json={"messages": MSG, "frobnicate": 1})
    assert "frobnicate" in assert_error(r, 400)["message"]


@pytest.mark.slow
def test_default_valued_unsupported_fields_are_accepted(url):
    body = {"prompt": "Hi", "max_tokens": 1, "echo": False, "best_of": 1, "logit_bias": {}}
    body |= {"user": "someone", "suffix": None}
    assert httpx.post(url + COMPLETIONS, json=body).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "content", [b"{not json", b'{"messages": [', b"", b"[1, 2]", b'"text"', b"null"]
)
def test_malformed_body_is_400_not_422(url, content):
    headers = {"content-type": "application/json"}
    assert_error(httpx.post(url + CHAT, content=content, headers=headers), 400)


@pytest.mark.slow
def test_unknown_route_is_openai_shaped_404(url):
    assert_error(httpx.get(f"{url}/v1/nothing"), 404)


@pytest.mark.slow
def test_prompt_longer_than_context_names_both_lengths(served, url):
    text = "hello " * 600
    n = tokens_of(served, text)
    assert n > MAX_MODEL_LEN
    error = assert_error(httpx.post(url + COMPLETIONS, json={"prompt": text}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and str(n) in error["message"]


@pytest.mark.slow
def test_prompt_plus_max_tokens_over_context_names_both_lengths(served, url):
    text = "hello " * 400
    n = tokens_of(served, text)
    assert n < MAX_MODEL_LEN < n + 200
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 200}
    error = assert_error(httpx.post(url + CHAT, json=body), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and "200" in error["message"]


def stream_events(r: httpx.Response) -> list[dict]:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def wait_for_free_blocks(engine, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        done = stats["kv_free_blocks"] == stats["kv_total_blocks"] and not stats["running"]
        if done or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.slow
def test_bad_requests_do_not_disturb_a_stream_in_flight(served):
    engine, url = served
    body = {
        "prompt": "Count with me: one, two,",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result: dict = {}
    first_chunk = threading.Event()

    def consume() -> None:
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=120) as r:
            result["status"] = r.status_code
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                    first_chunk.set()
                result["done"] = line == "data: [DONE]" or result.get("done", False)
            result["events"] = events

    thread = threading.Thread(target=consume)
    thread.start()
    assert first_chunk.wait(60)
    started = time.monotonic()
    for path, bad, status, param in BAD_REQUESTS:
        assert_error(httpx.post(url + path, json=bad), status, param)
    for content in (b"{oops", b"[]"):
        headers = {"content-type": "application/json"}
        assert_error(httpx.post(url + COMPLETIONS, content=content, headers=headers), 400)
    assert engine.stats()["running"] == 1, f"stream ended within {time.monotonic() - started:.1f} s"
    thread.join(120)
    assert result["status"] == 200 and result["done"]
    events = result["events"]
    assert all("error" not in e for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 400


@pytest.mark.slow
def test_client_disconnect_mid_stream_frees_its_blocks(served):
    engine, url = served
    body = {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
        assert engine.stats()["kv_free_blocks"] < engine.stats()["kv_total_blocks"]
    stats = wait_for_free_blocks(engine)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    assert stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.slow
def test_client_gone_during_non_streaming_request_frees_its_blocks(served):
    engine, url = served
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + COMPLETIONS, json=body, timeout=1.5)
    stats = wait_for_free_blocks(engine)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    assert stats["running"] == 0 and stats["waiting"] == 0
