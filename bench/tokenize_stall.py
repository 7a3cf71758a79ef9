"""Whether big /tokenize requests hold up another request's tokens, and keep their memory.

    python -m bench.tokenize_stall [--model smollm2-135m-instruct] [--repeats 3]

Starts `kvserve serve` on the CPU and streams greedy completions (the canary) while each case
below is sent ``--repeats`` times, one after another. Per request: its status, its time, the
canary's longest gap between two tokens while it ran and the next second (beside the longest
gap over as long with nothing else sent), and the server's RSS after it. The cases: bodies near
the 4 MiB limit, a text just under the length that /tokenize refuses without tokenizing it
(max_model_len times the longest token's characters: all of it tokenized, then refused), an
answer of almost max_model_len tokens with their strings, and chats of 60,000 and 2,048
messages.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from models.fetch import fetch
from models.tokenizer import Tokenizer

CANARY = {"prompt": "Count with me: one, two, three,", "ignore_eos": True, "stream": True}
START_S = 300


def cases(max_model_len: int, max_token_chars: int | None) -> dict[str, dict]:
    chat = [{"role": "user", "content": "hi"}]
    # Without a bound from the vocabulary every text is tokenized: then a megabyte of digits.
    bound = max_model_len * max_token_chars if max_token_chars else 10**6
    return {
        "4 MB of digits, with token strings": {
            "prompt": "1" * 4_000_000,
            "return_token_strs": True,
        },
        "3.9 MB of prose": {"prompt": "The quick brown fox jumps over the lazy dog. " * 86_000},
        f"{bound - 1} digits (tokenized, then refused)": {"prompt": "1" * (bound - 1)},
        f"{max_model_len - 8} digits, with token strings": {
            "prompt": "1" * (max_model_len - 8),
            "return_token_strs": True,
        },
        "60,000 chat messages": {"messages": chat * 60_000},
        "2,048 chat messages": {"messages": chat * 2048},
    }


class Server:
    """`kvserve serve` in a child process, on a free port."""

    def __init__(self, model: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = ["serve", "--model", str(model), "--device", "cpu", "--port", str(port)]
        code = "import sys; from server.cli import main; sys.exit(main())"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the canary's small model: one thread
        cmd = [sys.executable, "-c", code, *argv, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def rss_mib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS"))
        return int(line.split()[1]) // 1024

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Canary(threading.Thread):
    """Streams completions back to back until stopped, noting when each token came."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.body = url, {**CANARY, "max_tokens": max_tokens}
        self.times: list[float] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=self.body, timeout=600
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.perf_counter())
                    if self.stopping.is_set():
                        return

    def max_gap(self, start: float, end: float) -> float:
        ts = [t for t in self.times if start <= t <= end]
        return max((b - a for a, b in zip(ts, ts[1:])), default=float("nan"))


def run(model: Path, repeats: int) -> None:
    tok = Tokenizer.from_dir(model)
    server = Server(model)
    try:
        max_model_len = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
        canary = Canary(server.url, max_model_len // 2)
        canary.start()
        while len(canary.times) < 10:
            time.sleep(0.1)
        start = time.perf_counter()
        time.sleep(5)
        control = canary.max_gap(start, time.perf_counter())
        print(f"canary alone: longest gap {control * 1000:.0f} ms; RSS {server.rss_mib()} MiB")
        for name, body in cases(max_model_len, tok.max_token_chars).items():
            data = json.dumps(body).encode()
            for _ in range(repeats):
                start = time.perf_counter()
                r = httpx.post(server.url + "/tokenize", content=data, timeout=600,
                               headers={"content-type": "application/json"})  # fmt: skip
                took = time.perf_counter() - start
                time.sleep(1.0)
                gap = canary.max_gap(start, time.perf_counter())
                print(f"{name}: {r.status_code}, {len(r.content)} B in {took:.2f} s; longest "
                      f"gap {gap * 1000:.0f} ms; RSS {server.rss_mib()} MiB")  # fmt: skip
        canary.stopping.set()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or model folder")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    model = Path(args.model) if Path(args.model).is_dir() else fetch(args.model, progress=False)
    run(model, args.repeats)


if __name__ == "__main__":
    main()
