"""SIGTERM on a real `kvserve serve` process: a drain with a deadline, also when the engine is
stuck; a second signal exits at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import free_port, wait_until_healthy
from tests.server.test_server_errors import assert_error

DEADLINE_S = 2.0
# Start-up imports torch and loads the model: generous, it is not what is tested.
START_S = 120
# Past the deadline, what the server may take to end its streams and exit.
EXIT_MARGIN_S = 8.0

# The real CLI, with an engine whose first step with work never returns.
STUCK = """
import sys, threading
from engine.llm_engine import LLMEngine
from server.cli import main
step = LLMEngine.step
LLMEngine.step = lambda self: threading.Event().wait() if self.has_unfinished else step(self)
sys.exit(main(sys.argv[1:]))
"""


def start(
    model_dir, stuck: bool = False, deadline: float = DEADLINE_S
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["serve", "--model", str(model_dir), "--device", "cpu", "--num-kv-blocks", "64"]
    argv += ["--port", str(port), "--shutdown-timeout", str(deadline), "--log-level", "warning"]
    code = STUCK if stuck else "import sys; from server.cli import main; sys.exit(main())"
    # One torch thread: a tiny model's small matrices only thrash a second one.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, START_S)
    except AssertionError as e:
        proc.kill()
        raise AssertionError(f"{e}: {proc.communicate()[1].decode()}") from None
    return proc, url


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """Streams a completion in a thread; the dict gets its events and whether [DONE] came."""
    result: dict = {"events": [], "done": False, "started": threading.Event()}

    def consume() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            if r.status_code != 200:
                result["body"] = json.loads(r.read())
                result["started"].set()
                return
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    result["events"].append(json.loads(line.removeprefix("data: ")))
                    result["started"].set()

    def run() -> None:
        with contextlib.suppress(httpx.TransportError):  # a server killed on purpose
            consume()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


# Generates until the deadline: the shift policy with no practical max_tokens.
ENDLESS = {
    "prompt": [5, 6, 7, 8],
    "max_tokens": 10**6,
    "ignore_eos": True,
    "logprobs": 0,
    "stream": True,
    "overflow": {"policy": "shift"},
}


@pytest.mark.slow
def test_sigterm_drains_then_ends_what_is_left_at_the_deadline(tiny_llama_dir):
    proc, url = start(tiny_llama_dir)
    try:
        endless, endless_result = stream_in_thread(url, ENDLESS)
        assert endless_result["started"].wait(30)
        short = {"prompt": [5, 6], "max_tokens": 40, "ignore_eos": True, "logprobs": 0}
        short_thread, short_result = stream_in_thread(url, {**short, "stream": True})
        assert short_result["started"].wait(30)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with httpx.Client() as client:  # a new request during the drain
            r = client.post(url + "/v1/completions", json=short)
            assert assert_error(r, 503)["code"] == "shutting_down" and r.headers["Retry-After"]
            # Draining, it takes no traffic but is alive: no restart while requests finish.
            assert "shutting down" in assert_error(client.get(url + "/ready"), 503)["message"]
            assert client.get(url + "/health").status_code == 200
        short_thread.join(30)
        assert short_result["done"] and "error" not in short_result["events"][-1]
        endless.join(DEADLINE_S + EXIT_MARGIN_S)
        assert not endless.is_alive()
        last = endless_result["events"][-1]
        assert last["error"]["code"] == "shutting_down" and endless_result["done"]
        assert proc.wait(DEADLINE_S + EXIT_MARGIN_S) == 0
        assert time.monotonic() - signalled < DEADLINE_S + EXIT_MARGIN_S
    finally:
        proc.kill()


def stuck_with_a_request(
    model_dir, deadline: float
) -> tuple[subprocess.Popen, threading.Thread, dict]:
    """A server whose engine hangs in the step of the one request sent, signalled once."""
    proc, url = start(model_dir, stuck=True, deadline=deadline)
    waiting, result = stream_in_thread(url, {**ENDLESS, "max_tokens": 5})
    time.sleep(0.5)  # the engine took it and hangs in its step
    proc.send_signal(signal.SIGTERM)
    return proc, waiting, result


@pytest.mark.slow
def test_sigterm_exits_by_the_deadline_while_the_engine_is_stuck(tiny_llama_dir):
    proc, waiting, result = stuck_with_a_request(tiny_llama_dir, DEADLINE_S)
    signalled = time.monotonic()
    try:
        waiting.join(DEADLINE_S + EXIT_MARGIN_S)
        assert not waiting.is_alive()
        # It never got a first token, so no stream began: a plain 503.
        assert result["status"] == 503 and result["body"]["error"]["code"] == "shutting_down"
        assert proc.wait(DEADLINE_S + EXIT_MARGIN_S) == 0
        assert time.monotonic() - signalled < DEADLINE_S + EXIT_MARGIN_S
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tiny_llama_dir):
    proc, _, _ = stuck_with_a_request(tiny_llama_dir, deadline=60)
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_MARGIN_S) != 0  # long before the 60 s drain would end
    finally:
        proc.kill()


def test_sigterm_before_any_request_exits_cleanly(tiny_llama_dir):
    proc, _ = start(tiny_llama_dir)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(EXIT_MARGIN_S) == 0
    finally:
        proc.kill()
