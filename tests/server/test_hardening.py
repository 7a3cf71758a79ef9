"""A hostile client's requests beside a canary stream: each is refused or served on its own,
quickly, and the canary keeps its pace and its tokens. Limits, API keys, liveness."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.args import EngineArgs
from server.args import MIB, ServerArgs
from tests.helpers import serve_in_thread
from tests.server.test_server_errors import StubEngine, assert_error, wait_for_free_blocks

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CANARY = {"prompt": "Count with me: one, two, three,", "max_tokens": 40, "temperature": 0}
# Liveness bounds, far above what a healthy server needs and far below the stalls they catch
# (minutes for a fan-out, the whole tokenization of a large body for a blocked event loop).
ANSWER_S = 3.0
CANARY_GAP_S = 2.0


@contextlib.contextmanager
def server(model_dir, engine: dict, http: dict) -> Iterator[tuple[object, str]]:
    from engine.async_engine import AsyncEngine
    from server.app import build_app

    args = EngineArgs(model=str(model_dir), device="cpu", **engine)
    async_engine = AsyncEngine(args)
    try:
        with serve_in_thread(build_app(async_engine, ServerArgs(**http))) as url:
            yield async_engine, url
    finally:
        async_engine.shutdown()


class Canary(threading.Thread):
    """Streams one completion and records when each chunk came."""

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, {**body, "stream": True}, headers or {}
        self.times: list[float] = []
        self.text = ""
        self.done = False
        self.errors: list[dict] = []
        self.started_streaming = threading.Event()

    def run(self) -> None:
        with httpx.stream(
            "POST", self.url + COMPLETIONS, json=self.body, headers=self.headers, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    self.times.append(time.monotonic())
                    self.text += "".join(c["text"] for c in event["choices"])
                    self.started_streaming.set()

    def finish(self) -> Canary:
        self.join(120)
        assert not self.is_alive() and self.done and not self.errors, self.errors
        return self

    @property
    def max_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def alone(url: str, body: dict) -> str:
    r = httpx.post(url + COMPLETIONS, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample in /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def timed_post(url: str, body: dict | bytes, **kw) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    if isinstance(body, bytes):
        kw["content"] = body
        kw.setdefault("headers", {"content-type": "application/json"})
    else:
        kw["json"] = body
    r = httpx.post(url + COMPLETIONS, timeout=120, **kw)
    return r, time.monotonic() - start


# ---- the real model: a canary beside each kind of abuse ----

LIMITS = dict(max_request_bytes=3 * MIB, max_prompts_per_request=64, max_sequences_per_request=128)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    engine = dict(max_model_len=512, num_kv_blocks=128, max_num_seqs=8, max_queue_len=16)
    with server(smollm2_dir, engine, LIMITS) as pair:
        yield pair


@pytest.fixture(scope="module")
def canary_text(smol) -> str:
    return alone(smol[1], CANARY)


@pytest.mark.slow
def test_fan_out_is_refused_at_once_beside_a_canary(smol, canary_text):
    engine, url = smol
    queue_full = metric(url, "kvserve:requests_rejected_total", reason="queue_full")
    canary = Canary(url, CANARY)
    canary.start()
    assert canary.started_streaming.wait(60)
    r, took = timed_post(url, {"prompt": ["Hi"] * 2000, "n": 64, "max_tokens": 1})
    assert took < ANSWER_S
    error = assert_error(r, 400, "prompt")
    assert error["code"] == "too_many_prompts" and "64" in error["message"]
    r, took = timed_post(url, {"prompt": ["Hi"] * 20, "n": 8, "max_tokens": 1})
    assert took < ANSWER_S
    error = assert_error(r, 400, "n")
    assert error["code"] == "too_many_sequences" and "128" in error["message"]
    # Within the per-request limits, but more sequences than the whole queue holds.
    r, took = timed_post(url, {"prompt": "Hi", "n": 64, "max_tokens": 1})
    assert took < ANSWER_S
    assert "queue holds 16" in assert_error(r, 400, "n")["message"]
    # A group that fills the queue (7 of its 16 run beside the canary, 9 wait), then one that
    # does not fit beside it: 429 at once, all of it refused.
    filler = Canary(url, {"prompt": "Hi", "n": 16, "max_tokens": 20, "ignore_eos": True})
    filler.start()
    assert filler.started_streaming.wait(60)
    r, took = timed_post(url, {"prompt": "Hi", "n": 8, "max_tokens": 1})
    assert took < ANSWER_S
    assert assert_error(r, 429)["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
    filler.finish()
    assert canary.finish().text == canary_text
    assert canary.max_gap < CANARY_GAP_S
    # One refused request is one rejection, whatever its fan-out.
    assert metric(url, "kvserve:requests_rejected_total", reason="queue_full") == queue_full + 1
    stats = wait_for_free_blocks(engine)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"] and stats["waiting"] == 0


# (body, status, param): values that once crashed the engine step, now refused at the edge or
# served on their own. Raw JSON so that Infinity and NaN reach the server as Python parses them.
POISON = [
    ('{"prompt": "Hi", "max_tokens": 3, "repetition_penalty": 1e-80}', 400, "repetition_penalty"),
    ('{"prompt": "Hi", "max_tokens": 3, "repetition_penalty": 1e80}', 400, "repetition_penalty"),
    ('{"prompt": "Hi", "max_tokens": 3, "seed": 18446744073709551616}', 400, "seed"),
    (
        '{"prompt": "Hi", "max_tokens": 3, "stop_token_ids": [1000000000], "min_tokens": 2}',
        400,
        "stop_token_ids",
    ),  # fmt: skip
    ('{"prompt": "Hi", "max_tokens": 3, "stop_token_ids": [-1]}', 400, "stop_token_ids"),
    ('{"prompt": "Hi", "max_tokens": 3, "min_tokens": 9}', 400, "min_tokens"),
    ('{"prompt": "Hi", "max_tokens": 3, "temperature": Infinity}', 400, "temperature"),
    ('{"prompt": "Hi", "max_tokens": 3, "presence_penalty": NaN}', 400, "presence_penalty"),
    ('{"prompt": "Hi", "max_tokens": 3, "stream": "yes"}', 400, "stream"),
    ('{"prompt": [], "max_tokens": 3}', 400, "prompt"),
    ('{"prompt": "a\\ud800b", "max_tokens": 3}', 400, "prompt"),
    ('{"prompt": "Hi", "max_tokens": 3, "stop": ["\\udfff"]}', 400, "stop.0"),
    (
        '{"prompt": "Hi", "max_tokens": 3, "seed": 9223372036854775807, "n": 3, "temperature": 1}',
        200,
        None,
    ),  # fmt: skip
    ('{"prompt": "Hi", "max_tokens": 3, "repetition_penalty": 2, "temperature": 1}', 200, None),
]


@pytest.mark.slow
def test_poison_values_fail_alone_beside_a_canary(smol, canary_text):
    engine, url = smol
    canary = Canary(url, CANARY)
    canary.start()
    assert canary.started_streaming.wait(60)
    for body, status, param in POISON:
        r, took = timed_post(url, body.encode())
        assert took < 60
        if status == 200:
            assert r.status_code == 200, (body, r.text)
            assert all(c["finish_reason"] == "length" for c in r.json()["choices"]), r.text
        else:
            assert_error(r, status, param)
    chat = {"messages": [{"role": "user"}], "max_tokens": 2}
    assert_error(httpx.post(url + CHAT, json=chat), 400, "messages.0.content")
    assert canary.finish().text == canary_text
    # A temperature below 1e-5 is greedy (as vLLM): the canary's own tokens, not a crash.
    assert alone(url, {**CANARY, "temperature": 1e-50}) == canary_text


@pytest.mark.slow
def test_large_bodies_are_refused_or_tokenized_off_the_event_loop(smol, canary_text):
    engine, url = smol
    canary = Canary(url, {**CANARY, "max_tokens": 60})
    canary.start()
    assert canary.started_streaming.wait(60)
    big = json.dumps({"prompt": "x" * (5 * MIB), "max_tokens": 1}).encode()
    r, took = timed_post(url, big)
    error = assert_error(r, 413)
    assert str(3 * MIB) in error["message"] and took < ANSWER_S

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        for i in range(0, len(big), MIB):
            yield big[i : i + MIB]

    headers = {"content-type": "application/json"}
    r = httpx.post(url + COMPLETIONS, content=chunks(), headers=headers, timeout=60)
    assert "request_too_large" != assert_error(r, 413)["code"]  # found mid-body, not up front
    # Under the limit but far over the context: tokenized (seconds of work), then refused,
    # while the canary's tokens keep coming.
    text = "The quick brown fox jumps over the lazy dog. " * 50_000
    r, _ = timed_post(url, {"prompt": text, "max_tokens": 1})
    assert "maximum context length" in assert_error(r, 400)["message"]
    # /tokenize counts to max_model_len: a text far past it is refused from its length alone,
    # and a chat of more messages than OpenAI takes before they are all validated.
    chat = [{"role": "user", "content": "hi"}] * 60_000
    for body in ({"prompt": "1" * 3_000_000, "return_token_strs": True}, {"messages": chat}):
        start = time.monotonic()
        r = httpx.post(url + "/tokenize", json=body, timeout=120)
        assert time.monotonic() - start < ANSWER_S
        assert_error(r, 400, next(iter(body)))
    assert canary.finish().text.startswith(canary_text)
    assert canary.max_gap < CANARY_GAP_S


# ---- a tiny random model: API keys, limits and liveness without a real model's cost ----

KEYS = ("key-one", "key-two")
# The keyed server's --engine-hang-timeout: past its stall timeout (1 s) by more than a slow
# request to /health takes on a busy machine.
HANG_S = 4.0


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir):
    engine = dict(num_kv_blocks=64, max_num_seqs=8)
    http = dict(api_key=KEYS, engine_stall_timeout=1.0, engine_hang_timeout=HANG_S)
    with server(tiny_llama_dir, engine, http) as pair:
        yield pair


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_guard_every_route_but_probes_and_metrics(keyed):
    _, url = keyed
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    for headers in ({}, bearer("wrong"), {"Authorization": "Basic key-one"}):
        r = httpx.post(url + COMPLETIONS, json=body, headers=headers)
        error = assert_error(r, 401)
        assert error["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401)
        assert_error(httpx.post(url + "/detokenize", json={"tokens": [1]}, headers=headers), 401)
        assert_error(httpx.get(url + "/v1/nothing", headers=headers), 401)
    for key in KEYS:
        r = httpx.post(url + COMPLETIONS, json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(url + path).status_code == 200, path


def test_openai_client_sends_its_key(keyed):
    import openai

    _, url = keyed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[1], max_retries=0)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3)
    assert r.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def stick(engine, monkeypatch) -> threading.Event:
    """Makes the engine's next step with work in it hang until the returned event is set."""
    release = threading.Event()
    step = engine.engine.step

    def stuck_step():
        if engine.engine.has_unfinished:
            release.wait(30)
        return step()

    monkeypatch.setattr(engine.engine, "step", stuck_step)
    return release


def wait_for(url: str, status: int, seconds: float) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while (r := httpx.get(url)).status_code != status:
        assert time.monotonic() < deadline, f"{url} never answered {status}: {r.text}"
        time.sleep(0.1)
    return r


def test_a_stuck_engine_is_unready_at_the_stall_timeout_and_dead_at_the_hang_timeout(
    keyed, monkeypatch
):
    engine, url = keyed
    release = stick(engine, monkeypatch)
    headers = bearer(KEYS[0])
    with httpx.Client(timeout=60) as client:
        pending = threading.Thread(
            target=client.post,
            args=(url + COMPLETIONS,),
            kwargs={"json": {"prompt": [5, 6], "max_tokens": 2}, "headers": headers},
        )
        pending.start()
        r = wait_for(url + "/ready", 503, 10)
        assert "no progress" in assert_error(r, 503)["message"]
        # Slow is not dead: liveness holds until the step has run for the hang timeout.
        assert httpx.get(url + "/health").status_code == 200
        r = wait_for(url + "/health", 503, HANG_S + 10)
        assert "inside one step" in assert_error(r, 503)["message"]
        assert "inside one step" in assert_error(httpx.get(url + "/ready"), 503)["message"]
        release.set()
        pending.join(30)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/ready").status_code == 200
    stats = wait_for_free_blocks(engine)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_a_dead_engine_thread_fails_liveness_and_readiness(keyed, monkeypatch):
    engine, url = keyed
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    monkeypatch.setattr(engine, "_thread", ended)
    for path in ("/health", "/ready"):
        assert "has stopped" in assert_error(httpx.get(url + path), 503)["message"]


def test_gauges_count_queued_requests_before_any_step(keyed, monkeypatch):
    engine, url = keyed
    release = stick(engine, monkeypatch)
    body = {"prompt": [5, 6], "max_tokens": 2, "n": 3}
    post = threading.Thread(
        target=httpx.post,
        args=(url + COMPLETIONS,),
        kwargs=dict(json=body, headers=bearer(KEYS[0])),
    )
    post.start()
    try:
        deadline = time.monotonic() + 10
        while metric(url, "kvserve:num_requests_waiting") != 3:
            assert time.monotonic() < deadline, "the waiting gauge never counted the request"
            time.sleep(0.05)
    finally:
        release.set()
        post.join(30)


# ---- bodies that stop arriving ----


def server_fds(port: int) -> int:
    """The fds this process holds on connections accepted on ``port``: the server's ends."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state, inode = row.split()[1], row.split()[3], row.split()[9]
                if int(local.rsplit(":", 1)[1], 16) == port and state != "0A":  # 0A: listening
                    inodes.add(f"socket:[{inode}]")
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            held += os.readlink(f"/proc/self/fd/{fd}") in inodes
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed():
    """Clients that send headers and part of a body, then nothing: each is answered within the
    timeout, and the server's ends of their connections are closed."""
    from server.app import build_app

    timeout, n = 1.0, 50
    app = build_app(StubEngine(RuntimeError("unused")), ServerArgs(request_body_timeout=timeout))
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n").encode()  # fmt: skip
    with serve_in_thread(app) as url:
        host, port = url.removeprefix("http://").split(":")
        clients = [socket.create_connection((host, int(port))) for _ in range(n)]
        start = time.monotonic()
        for c in clients:
            c.sendall(head + b'{"messages": [')
        time.sleep(timeout / 2)
        assert server_fds(int(port)) == n  # the measure sees them while they wait
        for c in clients:
            c.settimeout(timeout + 5)
            answer = b""
            while chunk := c.recv(65536):  # until the server closes its end
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"stopped arriving" in answer
        assert time.monotonic() - start < timeout + 3
        assert server_fds(int(port)) == 0
        for c in clients:
            c.close()
        # A whole body still gets its answer; the route's own check follows.
        r = httpx.post(url + CHAT, json={"messages": []})
        assert r.status_code == 400, r.text


def test_serve_flags_build_server_args(monkeypatch):
    from server.cli import build_parser, server_args

    parser = build_parser()
    argv = ["serve", "--model", "m", "--api-key", "a", "--api-key", "b"]
    argv += ["--max-request-bytes", "100", "--shutdown-timeout", "5", "--port", "9000"]
    argv += ["--request-body-timeout", "2.5"]
    args = server_args(parser, parser.parse_args(argv))
    assert args == ServerArgs(api_key=("a", "b"), max_request_bytes=100, shutdown_timeout=5.0,
                              port=9000, request_body_timeout=2.5)  # fmt: skip
    with pytest.raises(SystemExit):
        server_args(parser, parser.parse_args(["serve", "--model", "m",
                                               "--request-body-timeout", "0"]))  # fmt: skip
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert server_args(parser, parser.parse_args(["serve", "--model", "m"])).api_key == (
        "from-env",
    )
    assert server_args(parser, parser.parse_args(argv)).api_key == ("a", "b")


def test_openapi_documents_400_not_422(keyed):
    _, url = keyed
    schema = httpx.get(url + "/openapi.json").json()
    for path in (COMPLETIONS, CHAT, "/tokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "413", "429", "503"} <= set(responses)
    assert "ErrorResponse" in schema["components"]["schemas"]
