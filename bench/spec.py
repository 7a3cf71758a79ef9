"""Speculative decoding against decoding without it, and against llama.cpp's, on the same box.

    python -m bench.spec [--target qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--rounds 2] [--out PREFIX]

Starts each server alone (kvserve plain, with the draft model, with n-gram lookup; llama.cpp's
server from ``../shared/peers`` plain, with the same draft GGUF file, with ``ngram-simple``) and
drives it with one client over the chat endpoint, greedy, streaming:

- code rewrite, one stream: ``prompts/code_rewrite.txt`` (rename two names in ~40 lines of
  code, reply with the whole code), decode tok/s = (tokens - 1) / (last - first token time);
- free-form questions, one stream, the same figure;
- free-form questions, 8 concurrent: total output tok/s (all tokens / wall time).

Each figure is the median over the requests of a pass, and over ``--rounds`` rounds (each
server in turn per round). Acceptance: kvserve's from its /metrics counters, llama.cpp's from
the ``timings`` of its answers (``draft_n``, ``draft_n_accepted``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.cpu import PEERS, Server, cpu_model, started
from bench.loadtest import counter_sum, parse_metrics
from models.fetch import resolve_model

PROMPTS = Path(__file__).parent / "prompts"
QUESTIONS = (
    "Why is the sky blue? Answer in a short paragraph.",
    "What are the main differences between a process and a thread?",
    "Explain what a hash table is to a beginner.",
    "Give three tips for writing readable code, with a sentence on each.",
    "What is the difference between TCP and UDP?",
    "Describe how a compiler differs from an interpreter.",
    "What does the CAP theorem say about distributed systems?",
    "Why do databases use indexes, and what do they cost?",
    "Explain recursion with a simple example in words.",
    "What is garbage collection in programming languages?",
    "How does public-key cryptography work, in simple terms?",
    "What makes a good unit test?",
    "Explain the idea of Big-O notation.",
    "What is the purpose of version control systems like git?",
    "Why are floating-point numbers sometimes inexact?",
    "What is a race condition and how can it be avoided?",
)


def server_list(target: str, draft: str, port: int) -> dict[str, Server]:
    """The six servers: kvserve's three modes and llama.cpp's three, same files."""
    import sys

    kv = str(Path(sys.executable).with_name("kvserve"))
    base = [kv, "serve", "--model", target, "--served-model-name", "qwen", "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "4096"]  # fmt: skip
    found = {
        "kvserve": Server("kvserve", "qwen", "gguf", base),
        "kvserve draft": Server(
            "kvserve draft", "qwen", "gguf", base + ["--speculative-model", draft]
        ),
        "kvserve ngram": Server(
            "kvserve ngram", "qwen", "gguf", base + ["--speculative-method", "ngram"]
        ),
    }
    script = Path(__file__).resolve().parents[2] / "shared/peers/llama-qwen.sh"
    if not script.exists() or not (PEERS / "llama-build/bin/llama-server").exists():
        return found
    for mode in ("plain", "draft", "ngram"):
        name = "llama.cpp" if mode == "plain" else f"llama.cpp {mode}"
        command = ["bash", str(script), mode, str(port), "-c", "16384"]
        found[name] = Server(name, "qwen", "gguf", command, {"SLOTS": "8", "PEERS": str(PEERS)})
    return found


async def chat(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: tokens, decode tok/s, and llama.cpp's draft timings."""
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    tokens, timings = 0, {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("timings"):
                timings = chunk["timings"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    decode = (tokens - 1) / (last - first) if first and last and last > first else None
    return dict(tokens=tokens, seconds=time.perf_counter() - start, decode_tok_s=decode,
                draft_n=timings.get("draft_n", 0),
                draft_accepted=timings.get("draft_n_accepted", 0))  # fmt: skip


async def metrics(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """kvserve's (drafted, accepted) counters; (0, 0) where there are none."""
    try:
        resp = await client.get(url + "/metrics")
        _, counters = parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return 0.0, 0.0
    return (counter_sum(counters, "spec_decode_num_draft_tokens_total"),
            counter_sum(counters, "spec_decode_num_accepted_tokens_total"))  # fmt: skip


async def workload(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Requests over ``texts`` at ``concurrency``: median decode tok/s, total output tok/s and
    the share of drafts accepted."""
    async with httpx.AsyncClient(timeout=600) as client:
        before = await metrics(client, url)
        gate = asyncio.Semaphore(concurrency)

        async def one(text: str) -> dict:
            async with gate:
                return await chat(client, url, text, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - start
        after = await metrics(client, url)
    drafted = after[0] - before[0] or sum(r["draft_n"] for r in results)
    accepted = after[1] - before[1] or sum(r["draft_accepted"] for r in results)
    decode = [r["decode_tok_s"] for r in results if r["decode_tok_s"]]
    return dict(
        decode_tok_s=statistics.median(decode) if decode else None,
        total_tok_s=sum(r["tokens"] for r in results) / wall,
        tokens=[r["tokens"] for r in results],
        accepted_pct=100 * accepted / drafted if drafted else None,
    )


def run(server: Server, port: int, log_dir: Path, rewrite: str) -> dict:
    with started(server, port, log_dir) as root:
        if root is None:
            return {"error": f"did not start (see {log_dir / server.name}.log)"}
        asyncio.run(workload(root, [QUESTIONS[0]], 1, 16))  # warm-up, not kept
        loads = {
            "code rewrite, 1 stream": ([rewrite] * 2, 1, 600),
            "questions, 1 stream": (list(QUESTIONS[:3]), 1, 150),
            "questions, 8 concurrent": (list(QUESTIONS), 8, 150),
        }
        out = {}
        for name, (texts, concurrency, max_tokens) in loads.items():
            try:
                out[name] = asyncio.run(workload(root, texts, concurrency, max_tokens))
            except httpx.HTTPError as e:  # the server failed: the figure is missing, said why
                return {"error": f"{name}: {type(e).__name__}: {e}", **out}
        return out


def merge(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds."""
    if any("error" in r for r in rounds):
        return next(r for r in rounds if "error" in r)
    out = {}
    for w in rounds[0]:
        out[w] = {}
        for key in ("decode_tok_s", "total_tok_s", "accepted_pct"):
            values = [r[w][key] for r in rounds if r[w][key] is not None]
            out[w][key] = statistics.median(values) if values else None
        out[w]["tokens"] = rounds[0][w]["tokens"]
    return out


def table(results: dict) -> str:
    head = ["server", "code rewrite 1 stream tok/s", "accepted %", "questions 1 stream tok/s",
            "accepted %", "questions 8 concurrent total tok/s", "accepted %"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = [name]
        for w, key in (("code rewrite, 1 stream", "decode_tok_s"),
                       ("questions, 1 stream", "decode_tok_s"),
                       ("questions, 8 concurrent", "total_tok_s")):  # fmt: skip
            cells += [_f(r[w][key]), _f(r[w]["accepted_pct"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(results: dict) -> list[str]:
    """The issue's comparisons, where both sides ran."""

    def get(name: str, w: str, key: str) -> float | None:
        r = results.get(name)
        return None if r is None or "error" in r else r[w][key]

    rw, q8 = "code rewrite, 1 stream", "questions, 8 concurrent"
    pairs = [
        ("kvserve draft / kvserve, code rewrite", get("kvserve draft", rw, "decode_tok_s"),
         get("kvserve", rw, "decode_tok_s"), 2.0),
        ("kvserve draft / llama.cpp draft, code rewrite", get("kvserve draft", rw, "decode_tok_s"),
         get("llama.cpp draft", rw, "decode_tok_s"), 3.0),
        ("kvserve ngram / kvserve, code rewrite", get("kvserve ngram", rw, "decode_tok_s"),
         get("kvserve", rw, "decode_tok_s"), 1.5),
        ("kvserve ngram / llama.cpp ngram, code rewrite", get("kvserve ngram", rw, "decode_tok_s"),
         get("llama.cpp ngram", rw, "decode_tok_s"), 1.0),
        ("kvserve draft / kvserve, questions 8 concurrent", get("kvserve draft", q8, "total_tok_s"),
         get("kvserve", q8, "total_tok_s"), 1.0),
        ("kvserve ngram / kvserve, questions 8 concurrent", get("kvserve ngram", q8, "total_tok_s"),
         get("kvserve", q8, "total_tok_s"), 1.0),
    ]  # fmt: skip
    lines = ["| ratio | measured | target |", "|---|---|---|"]
    for label, a, b, goal in pairs:
        value = a / b if a and b else None
        met = "" if value is None else (" (met)" if value >= goal else " (not met)")
        lines.append(f"| {label} | {_f(value, 2)}{met} | >= {goal} |")
    return lines


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--servers", nargs="+", help="names to run (default: all that are set up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8231)
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    resolve_model(args.target), resolve_model(args.draft)  # fetched before any timing
    found = server_list(args.target, args.draft, args.port)
    names = args.servers or list(found)
    rewrite = (PROMPTS / "code_rewrite.txt").read_text()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kvserve-bench-spec"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names:
            print(f"round {i + 1}: {name}", flush=True)
            rounds[name].append(run(found[name], args.port, log_dir, rewrite))
            print(json.dumps(rounds[name][-1]), flush=True)
    results = {name: merge(r) for name, r in rounds.items()}
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    md = [
        f"# Speculative decoding, {args.target} (draft {args.draft}), {date}",
        "",
        f"Box: {cpu_model()}, {os.cpu_count()} cores. Command: `python -m bench.spec "
        f"--rounds {args.rounds}`. Greedy, streamed chat requests, one client; medians over "
        f"the requests and over {args.rounds} rounds (each server alone on the box).",
        "",
        table(results),
        "",
        *ratios(results),
    ]
    text = "\n".join(md)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps({"rounds": rounds, "results": results},
                                                       indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
