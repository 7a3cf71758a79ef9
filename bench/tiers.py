"""Returning conversations with and without the host and disk tiers of the prefix cache.

    python -m bench.tiers [--model smollm2-135m-instruct] [--users 4] [--rounds 4]
        [--system 512] [--history 1024] [--turn 64] [--answer 32] [--num-kv-blocks 48]
        [--host-gib 0.25] [--disk-host-gib 0.12] [--disk-gib 2] [--repeat 1] [--out PREFIX]

LMCache's multi-round QA shape, scaled to a 2-core CPU: ``--users`` chat sessions share a
system prompt of ``--system`` tokens, each has ``--history`` tokens of its own, and they take
``--rounds`` turns each, every turn resending the conversation so far with a ``--turn``-token
question and answered in ``--answer`` tokens (the load tester's session workload, ``kvserve
bench --turns --session-history``), one user at a time. The device pool
(``--num-kv-blocks``) is too small to keep every conversation, so by the time a user returns,
the others have evicted its history. Each server runs alone, started fresh: kvserve without
the tier, then with ``--kv-host-cache-gib``, then with a host tier too small for the
conversations (``--disk-host-gib``) over a disk tier (``--disk-gib``, a fresh folder under
``--log-dir``), so that returning conversations come back from disk. Per server: median TTFT
by round (round 1 computes everything; later rounds recompute the history without a tier and
copy it back up with one), the share of prompt tokens the prefix cache served, and then a
pass with no reuse at all (distinct prompts, one turn each, 4 at a time) for the throughput a
tier costs when nothing comes back. Each tier's blocks are read from /metrics at the end of
each run, with its capacity: the bound holds if the first never exceeds the second.
``--repeat N`` runs the servers in turn N times and reports each figure's median (the box's
speed moves from minute to minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.cpu import Server, cpu_model, started
from bench.loadtest import BenchConfig, run_benchmark
from models.fetch import resolve_model

PORT = 8017


def sessions(args, root: str, rounds: int, users: int, concurrency: int, seed: int):
    config = BenchConfig(
        base_url=root + "/v1", model="kvserve", num_prompts=users * rounds, turns=rounds,
        prefix_len=args.system, prefix_fraction=1.0 if args.system else 0.0,
        session_history=args.history if rounds > 1 else 0, input_len=args.turn,
        output_len=args.answer, max_concurrency=concurrency,
        ignore_eos=True, scrape_interval_s=0, seed=seed,
    )  # fmt: skip
    return asyncio.run(run_benchmark(config)).summary


def run(args, name: str, extra: list[str], log_dir: Path) -> dict:
    command = [
        str(Path(sys.executable).with_name("kvserve")), "serve", "--model", str(args.model_dir),
        "--served-model-name", "kvserve", "--host", "127.0.0.1", "--port", str(PORT),
        "--max-model-len",
        str(args.system + args.history + args.rounds * (args.turn + args.answer) + 64),
        "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "4", *extra,
    ]  # fmt: skip
    with started(Server(name, "kvserve", "", command), PORT, log_dir) as root:
        if root is None:
            return {"error": f"did not start (see {log_dir / name}.log)"}
        sessions(args, root, 1, 1, 1, seed=999)  # warm-up, not kept
        s = sessions(args, root, args.rounds, args.users, 1, seed=1)
        rounds = [dict(round=t.turn, ttft_ms=t.ttft.median_ms, cached=t.cached_fraction,
                       completed=t.completed) for t in s.by_turn]  # fmt: skip
        reuse_free = sessions(args, root, 1, 4 * args.users, 4, seed=2)
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(httpx.get(root + "/metrics").text)
            for sample in family.samples
            if not sample.labels
        }
    return dict(
        rounds=rounds, failed=s.failed + reuse_free.failed,
        no_reuse_tok_s=reuse_free.output_throughput,
        no_reuse_ttft_ms=reuse_free.ttft.median_ms,
        host_blocks=samples.get("kvserve:kv_host_cache_blocks"),
        host_capacity=samples.get("kvserve:kv_host_capacity_blocks"),
        host_hits=samples.get("kvserve:prefix_cache_host_hits_total"),
        disk_blocks=samples.get("kvserve:kv_disk_cache_blocks"),
        disk_capacity=samples.get("kvserve:kv_disk_capacity_blocks"),
        disk_hits=samples.get("kvserve:prefix_cache_disk_hits_total"),
    )  # fmt: skip


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the first error, if any run failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    first = runs[0]
    rounds = [
        {**row, "ttft_ms": statistics.median(r["rounds"][i]["ttft_ms"] for r in runs)}
        for i, row in enumerate(first["rounds"])
    ]
    return {**first, "rounds": rounds, "runs": len(runs),
            "failed": sum(r["failed"] for r in runs),
            "no_reuse_tok_s": statistics.median(r["no_reuse_tok_s"] for r in runs),
            "no_reuse_tok_s_each": [r["no_reuse_tok_s"] for r in runs],
            "host_blocks": max((r["host_blocks"] or 0) for r in runs),
            "disk_blocks": max((r["disk_blocks"] or 0) for r in runs)}  # fmt: skip


def table(results: dict) -> str:
    off = results.get("off", {})
    lines = ["| server | round | median TTFT ms | vs no tier | prefix cache hits |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | – | {r['error']} | | |")
            continue
        for row, base in zip(r["rounds"], off.get("rounds", r["rounds"])):
            ratio = row["ttft_ms"] / base["ttft_ms"] if base["ttft_ms"] else None
            cached = "–" if row["cached"] is None else f"{row['cached']:.0%}"
            lines.append(f"| {name} | {row['round']} | {row['ttft_ms']:.0f} "
                         f"| {ratio:.2f}x | {cached} |")  # fmt: skip
    lines += ["", "| server | no reuse: output tok/s | vs no tier | host blocks / capacity "
              "| disk blocks / capacity |", "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            continue
        ratio = r["no_reuse_tok_s"] / off["no_reuse_tok_s"] if off.get("no_reuse_tok_s") else 1
        tiers = [
            "–"
            if r[f"{t}_capacity"] is None
            else f"{r[f'{t}_blocks']:.0f} / {r[f'{t}_capacity']:.0f}"
            for t in ("host", "disk")
        ]
        lines.append(f"| {name} | {r['no_reuse_tok_s']:.1f} | {ratio:.2f}x | {tiers[0]} "
                     f"| {tiers[1]} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    parser.add_argument(
        "--history",
        type=int,
        default=1024,
        help="each user's own tokens ahead of its first question",
    )
    parser.add_argument("--turn", type=int, default=64, help="question tokens per turn")
    parser.add_argument("--answer", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--num-kv-blocks", type=int, default=48)
    parser.add_argument("--host-gib", type=float, default=0.25)
    parser.add_argument("--disk-host-gib", type=float, default=0.12,
                        help="the host tier above the disk tier")  # fmt: skip
    parser.add_argument("--disk-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of both servers, in turn")
    parser.add_argument("--log-dir", default="/tmp/kvserve-tiers")
    parser.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    args.model_dir = resolve_model(args.model)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    disk = log_dir / "disk-tier"
    servers = {
        "off": [],
        "host": ["--kv-host-cache-gib", str(args.host_gib)],
        "disk": ["--kv-host-cache-gib", str(args.disk_host_gib), "--kv-disk-cache-dir",
                 str(disk), "--kv-disk-cache-gib", str(args.disk_gib)],
    }  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for _ in range(args.repeat):  # the servers in turn: a slow minute hits each
        for name, extra in servers.items():
            shutil.rmtree(disk, ignore_errors=True)  # a fresh disk tier for each run
            runs[name].append(run(args, name, extra, log_dir))
            print(f"{name}: {runs[name][-1]}", flush=True)
    results = {name: medians(r) for name, r in runs.items()}
    text = table(results)
    words = sys.argv[1:] if argv is None else argv
    head = (f"box: {os.cpu_count()} cores, {cpu_model()}; "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n"
            f"command: python -m bench.tiers {' '.join(words)}")  # fmt: skip
    print(f"\n{head}\n\n{text}")
    if args.out:
        Path(f"{args.out}.md").write_text(f"# Returning conversations and the KV tiers\n\n"
                                          f"{head}\n\n{text}\n")  # fmt: skip
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    return int(any("error" in r or r["failed"] for r in results.values()))


if __name__ == "__main__":
    raise SystemExit(main())
