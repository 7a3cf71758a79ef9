"""CPU serving speed next to its roofline, and next to the peers on the same box.

    python -m bench.cpu [--model smollm2-135m-instruct] [--prompts 16] [--concurrency 1 8]
        [--servers kvserve llama.cpp-f32 llama.cpp-q4_1 vllm-cpu-fp32] [--rounds 1]
        [--out PREFIX]
    python -m bench.cpu --interleave [--servers ...] [--prompts 16] [--out PREFIX]
    python -m bench.cpu --interleave --servers kvserve-baseline kvserve --baseline DIR
    python -m bench.cpu --linear [--rows 1 2 4 8 16 32 64 128]

Measures the box's memory read bandwidth (a sum over 1 GiB, all torch threads), then starts each
server alone, waits for /health, and drives it with the same client (``bench.loadtest``: random
prompts of --input-len tokens, --output-len tokens each, ignore_eos), one pass per concurrency.
Peers come from ``../shared/peers/setup.sh`` (under ``$PEERS``, default /tmp/peers) and are
skipped when absent. Each server first answers one request that is not kept (warm-up). Per
server: decode tok/s of one stream (1000 / median TPOT), its fraction of the roofline (read
bandwidth / weight bytes read per step), median TTFT of one stream, and the total output tok/s
at each higher concurrency. Each pass draws its own prompts (seed + concurrency), so no
server answers from a prompt cache filled by an earlier pass. Compare
figures of the same run only: the box's bandwidth moves from run to run, and within a run
(another tenant's load); ``--rounds N`` runs the servers in turn N times and reports each
figure's median, so that a slow minute does not decide the comparison.

``--interleave`` compares one stream with the box's swings taken out: all servers start
together (each idle while another serves) and every prompt goes to each server in turn, one
request at a time on a quiet box, in an order shuffled per prompt. Per server: median TPOT and
TTFT over the prompts, and the median over prompts of its TPOT divided by the first server's on
the same prompt (the paired comparison). The bandwidth is measured every four prompts.
``--baseline DIR`` adds ``kvserve-baseline``: kvserve from the source folder of another checkout
(``git worktree add DIR REV``), so that a change is compared with what it changed, paired.

``--linear`` times the linear layers of the model's shapes alone: ``kernels.cpu.linear`` against
``F.linear`` by input rows (where ``kernels.cpu.MAX_ROWS`` comes from).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F
from safetensors import safe_open

from bench.kernel_speed import Timer, read_bandwidth
from bench.loadtest import (
    BenchConfig,
    PromptCalibration,
    RequestRecord,
    calibrate_prompts,
    request_body,
    run_benchmark,
    send_request,
    synthetic_requests,
)
from kernels import cpu
from kernels.weights import Weight
from models.config import ModelConfig
from models.fetch import resolve_model

PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
SERVERS = ("kvserve", "llama.cpp", "llama.cpp-f32", "llama.cpp-q4_1", "vllm-cpu-fp32")
BASELINE = "kvserve-baseline"  # kvserve from another checkout (--baseline), for before/after


@dataclass
class Server:
    name: str
    model: str  # the name clients ask for
    weights: str  # what each decode step reads: "fp32", "Q4_1"
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def servers(
    model_dir: Path, port: int, kvserve_args: list[str], baseline: str | None = None
) -> dict[str, Server | str]:
    """Each server by name, or why it cannot run here. ``baseline``: the source folder of
    another kvserve checkout (a ``git worktree`` of an earlier commit), served by this
    environment's packages as ``kvserve-baseline``, with its C++ kernels built apart."""
    threads = str(os.cpu_count())
    kv = Path(sys.executable).with_name("kvserve")
    command = [
        str(kv), "serve", "--model", str(model_dir), "--served-model-name", "kvserve",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", *kvserve_args,
    ]  # fmt: skip
    gguf = model_dir / "model.gguf"  # a model served from its GGUF file, in its block formats
    ours = "gguf" if gguf.exists() else "fp32"
    found: dict[str, Server | str] = {"kvserve": Server("kvserve", "kvserve", ours, command)}
    if baseline is None:
        found[BASELINE] = "no --baseline checkout given"
    else:
        env = {"PYTHONPATH": baseline, "TORCH_EXTENSIONS_DIR": f"{baseline}/.torch_extensions"}
        found[BASELINE] = Server(BASELINE, "kvserve", ours, command, env)
    llama = PEERS / "llama-build/bin/llama-server"
    if not llama.exists() or not gguf.exists():
        found["llama.cpp"] = f"needs {llama} (../shared/peers/setup.sh) and a GGUF-served model"
    else:
        found["llama.cpp"] = Server("llama.cpp", "kvserve", "gguf", [
            str(llama), "-m", str(gguf.resolve()), "--alias", "kvserve", "--host", "127.0.0.1",
            "--port", str(port), "-c", "8192", "-np", "8", "-t", threads,
        ])  # fmt: skip
    for name, gguf, weights in (("llama.cpp-f32", "smollm2-f32.gguf", "fp32"),
                                ("llama.cpp-q4_1", "smollm2-q4_1.gguf", "Q4_1")):  # fmt: skip
        path = PEERS / "gguf" / gguf
        if not llama.exists() or not path.exists():
            found[name] = f"not set up ({llama}, {path}): run ../shared/peers/setup.sh"
            continue
        found[name] = Server(name, "smollm2", weights, [
            str(llama), "-m", str(path), "--alias", "smollm2", "--host", "127.0.0.1", "--port",
            str(port), "-c", "4096", "-np", "8", "-t", threads,
        ])  # fmt: skip
    vllm = PEERS / "vllm"
    if vllm.exists():
        found["vllm-cpu-fp32"] = Server("vllm-cpu-fp32", "smollm2", "fp32", [
            str(vllm), "serve", str(PEERS / "smollm2-hf"), "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--dtype", "float32",
        ], {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "2"})  # fmt: skip
    else:
        found["vllm-cpu-fp32"] = f"not set up ({vllm}): run ../shared/peers/setup.sh"
    return found


def weight_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes read per decode step by weights kind: every matrix once; the embedding table only
    when it is also the output layer (tied). A GGUF-served model: its tensors as stored."""
    if (model_dir / "model.gguf").exists():
        from models.gguf_import import open_gguf

        tensors = open_gguf(model_dir / "model.gguf").tensors
        tied = all(t.name != "output.weight" for t in tensors)
        read = [t for t in tensors if tied or t.name != "token_embd.weight"]
        return {"gguf": sum(int(t.n_bytes) for t in read)}
    cfg = ModelConfig.from_dir(model_dir)
    tied = cfg.get("tie_word_embeddings", False)
    numel = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                shape = f.get_slice(name).get_shape()
                numel += int(torch.Size(shape).numel())
    return {"fp32": numel * 4, "Q4_1": numel * 20 // 32}  # Q4_1: 20 bytes per 32 weights


def box_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a sum over ``gib`` GiB of float32, median of 7 (torch threads)."""
    return read_bandwidth(Timer("cpu", repeats=7, warmup=2), "cpu", int(gib * 2**30))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def resident_bytes(pid: int) -> int:
    """Resident memory of the process and its children (VmRSS, the file pages it maps
    included)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():  # self, thread-self and the kernel's files
            continue
        try:
            status = (proc / "status").read_text()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if int(proc.name) == pid or int(stat[2]) == pid:  # itself or its group's members
            rss = next((ln for ln in status.splitlines() if ln.startswith("VmRSS:")), None)
            total += int(rss.split()[1]) * 1024 if rss else 0
    return total


@contextlib.contextmanager
def started(server: Server, port: int, log_dir: Path, facts: dict | None = None):
    """Run ``server`` on ``port`` for the block: yields its root URL, or None when it did not
    become healthy (its log says why); stopped after. ``facts`` gets the seconds to healthy
    (``startup_s``) and the resident memory then (``rss_mb``)."""
    log = log_dir / f"{server.name}.log"
    begun = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **server.env},
        )  # fmt: skip
    root = f"http://127.0.0.1:{port}"
    try:
        if not _wait_healthy(root, proc):
            yield None
            return
        if facts is not None:
            facts["startup_s"] = time.perf_counter() - begun
            facts["rss_mb"] = resident_bytes(proc.pid) / 2**20
        time.sleep(2)  # let start-up work (warm-up, compilation) settle
        yield root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_server(server: Server, port: int, args: argparse.Namespace, log_dir: Path) -> dict:
    facts: dict = {}
    with started(server, port, log_dir, facts) as root:
        if root is None:
            return {"error": f"did not start (see {log_dir / server.name}.log)"}

        def config(c: int, prompts: int) -> BenchConfig:
            return BenchConfig(
                base_url=root + "/v1", model=server.model, num_prompts=prompts,
                max_concurrency=c, input_len=args.input_len, output_len=args.output_len,
                ignore_eos=True, scrape_interval_s=0, seed=args.seed + c,
            )  # fmt: skip

        asyncio.run(run_benchmark(config(1, 1)))  # warm-up, not kept
        passes = {}
        for c in args.concurrency:
            s = asyncio.run(run_benchmark(config(c, args.prompts))).summary
            passes[c] = dict(
                output_tok_s=s.output_throughput, ttft_ms=s.ttft.median_ms,
                tpot_ms=s.tpot.median_ms, failed=s.failed, completed=s.completed,
            )  # fmt: skip
        return {**passes, "start": facts}


def median_passes(rounds: list[dict]) -> dict:
    """Per concurrency, the median of each figure over the rounds (failures summed)."""
    merged = {}
    for c in rounds[0]:
        if c == "start":
            merged[c] = {k: statistics.median(r[c][k] for r in rounds) for k in rounds[0][c]}
            continue
        runs = [r[c] for r in rounds]
        merged[c] = {k: statistics.median(r[k] for r in runs)
                     for k in ("output_tok_s", "ttft_ms", "tpot_ms")}  # fmt: skip
        merged[c].update(failed=sum(r["failed"] for r in runs),
                         completed=sum(r["completed"] for r in runs))  # fmt: skip
    return merged


def table(results: dict, bandwidth: float, step_bytes: dict[str, int], conc: list[int]) -> str:
    higher = [c for c in conc if c != 1]
    head = ["server (weights)", "1 stream decode tok/s", "% of roofline", "TTFT ms"]
    head += [f"{c} concurrent total tok/s" for c in higher] + ["start-up s", "RSS after start MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * (len(head) - 2))
            continue
        one = r["passes"].get(1)
        tok_s = 1000 / one["tpot_ms"] if one and one["tpot_ms"] else None
        roof = bandwidth / step_bytes[r["weights"]]
        cells = [f"{name} ({r['weights']})", _f(tok_s), _f(tok_s and 100 * tok_s / roof),
                 _f(one and one["ttft_ms"])]  # fmt: skip
        cells += [_f(r["passes"][c]["output_tok_s"]) for c in higher]
        start = r["passes"].get("start", {})
        cells += [_f(start.get("startup_s")), _f(start.get("rss_mb"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_line(bandwidth: list[float], args: argparse.Namespace, how: str) -> str:
    """The bandwidth measurements and the load, above a table."""
    bw = statistics.median(bandwidth)
    return (f"read bandwidth {bw / 1e9:.1f} GB/s (median of {len(bandwidth)} measurements, "
            f"{min(bandwidth) / 1e9:.1f}–{max(bandwidth) / 1e9:.1f}); {args.prompts} prompts of "
            f"{args.input_len} tokens, {args.output_len} out, {how}")  # fmt: skip


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def bench_servers(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    step_bytes = weight_bytes(model_dir)
    available = servers(model_dir, args.port, args.kvserve_args, args.baseline)
    bandwidth = [box_bandwidth()]
    kind, step = next(iter(step_bytes.items()))
    print(
        f"box: {os.cpu_count()} cores, {cpu_model()}; read bandwidth {bandwidth[0] / 1e9:.1f} "
        f"GB/s; {kind} weights read per step {step / 1e6:.0f} MB (roofline "
        f"{bandwidth[0] / step:.1f} tok/s)",
        flush=True,
    )
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results, rounds = {}, {}
    for i in range(args.rounds):
        for name in args.servers:
            server = available[name]
            if isinstance(server, str):
                if i == 0:
                    print(f"{name}: skipped, {server}", flush=True)
                continue
            if "error" in results.get(name, {}):
                continue
            start = time.perf_counter()
            passes = run_server(server, args.port, args, log_dir)
            print(f"{name} (round {i + 1}): {passes} ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
            if "error" in passes:
                results[name] = {"weights": server.weights, **passes}
                continue
            rounds.setdefault(name, []).append(passes)
            results[name] = {"weights": server.weights, "passes": median_passes(rounds[name]),
                             "rounds": rounds[name]}  # fmt: skip
            bandwidth.append(box_bandwidth())
    bw = statistics.median(bandwidth)
    text = table(results, bw, step_bytes, args.concurrency)
    how = f"per pass; servers in turn, {args.rounds} round(s), medians"
    print(f"\n{_run_line(bandwidth, args, how)}\n\n{text}")
    if args.out:
        _write(args, results, bandwidth, step_bytes, text)
    return 0


async def interleaved_requests(
    targets: dict[str, tuple[Server, str]], args: argparse.Namespace, on_prompt=None
) -> dict[str, list[RequestRecord]]:
    """One stream at a time: each prompt goes to every server in turn (in an order shuffled per
    prompt), so all servers meet the box in the same state; before each request the box is let
    go quiet (a server may keep a core busy for a while after it answered: vLLM-CPU ~1 s). The
    first prompt warms them up and is not kept. ``on_prompt(i)`` runs before prompt i."""
    config = BenchConfig(
        num_prompts=args.prompts + 1, input_len=args.input_len, output_len=args.output_len,
        ignore_eos=True, seed=args.seed + 1, max_concurrency=1,
    )  # fmt: skip
    names = list(targets)
    order = random.Random(args.seed)
    records: dict[str, list[RequestRecord]] = {name: [] for name in names}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), trust_env=False) as client:
        calibration = None
        for server, root in targets.values():  # the same prompts for all: one tokenizer
            calibration = await calibrate_prompts(client, root, server.model, chat=False)
            if calibration is not None:
                break
        requests = synthetic_requests(config, calibration or PromptCalibration())
        for i, req in enumerate(requests):
            if on_prompt is not None:
                on_prompt(i)
            order.shuffle(names)
            for name in names:
                server, root = targets[name]
                await quiet()
                rec = RequestRecord(index=i, scheduled_s=0.0)
                body = request_body(config, server.model, req)
                await send_request(client, root + "/v1/completions", body, rec, time.perf_counter())
                if i > 0:
                    records[name].append(rec)
    return records


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all cores from /proc/stat; None where it cannot be read."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])


async def quiet(window_s: float = 0.25, busy: float = 0.25, limit_s: float = 10.0) -> None:
    """Wait until less than ``busy`` of a core was in use over ``window_s`` (at most
    ``limit_s``; at once where /proc/stat cannot be read)."""
    last = _cpu_times()
    deadline = time.monotonic() + limit_s
    while last is not None and time.monotonic() < deadline:
        await asyncio.sleep(window_s)
        now = _cpu_times()
        if now is None or now[1] <= last[1]:
            return
        if os.cpu_count() * (1 - (now[0] - last[0]) / (now[1] - last[1])) < busy:
            return
        last = now


def paired_summary(records: dict[str, list[RequestRecord]], first: str) -> dict[str, dict]:
    """Per server: median TPOT and TTFT (ms) of its successful requests, failures, and the
    median over prompts of its TPOT divided by ``first``'s on the same prompt (above 1:
    ``first`` was faster on the typical prompt)."""
    out = {}
    for name, recs in records.items():
        ok = [r for r in recs if r.tpot_s is not None]
        pairs = [
            r.tpot_s / f.tpot_s
            for r, f in zip(recs, records[first], strict=True)
            if r.tpot_s is not None and f.tpot_s is not None
        ]
        out[name] = {
            "tpot_ms": statistics.median(r.tpot_s for r in ok) * 1e3 if ok else None,
            "ttft_ms": statistics.median(r.ttft_s for r in ok) * 1e3 if ok else None,
            "failed": len(recs) - len(ok),
            "tpot_vs_first": statistics.median(pairs) if pairs else None,
        }
    return out


def paired_table(summary: dict, weights: dict[str, str], bandwidth: float, step_bytes, first):
    head = ["server (weights)", "1 stream decode tok/s", "% of roofline", "TTFT ms",
            f"its TPOT / {first}'s, same prompt (median)", "failed"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in summary.items():
        tok_s = 1000 / r["tpot_ms"] if r["tpot_ms"] else None
        roof = bandwidth / step_bytes[weights[name]]
        cells = [f"{name} ({weights[name]})", _f(tok_s), _f(tok_s and 100 * tok_s / roof),
                 _f(r["ttft_ms"]), _f(r["tpot_vs_first"], 3), str(r["failed"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_interleaved(args: argparse.Namespace) -> int:
    """All servers up at once (each idle while another serves), one stream, prompts in turn."""
    model_dir = resolve_model(args.model)
    step_bytes = weight_bytes(model_dir)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = [box_bandwidth()]
    targets, results = {}, {}
    with contextlib.ExitStack() as stack:
        for i, name in enumerate(args.servers):
            server = servers(model_dir, args.port + i, args.kvserve_args, args.baseline)[name]
            if isinstance(server, str):
                print(f"{name}: skipped, {server}", flush=True)
                continue
            root = stack.enter_context(started(server, args.port + i, log_dir))
            if root is None:
                results[name] = {"weights": server.weights, "error": "did not start"}
                print(f"{name}: did not start (see {log_dir / name}.log)", flush=True)
                continue
            targets[name] = (server, root)
        if not targets:
            return 1

        def measure(i: int) -> None:  # the box's bandwidth every 4 prompts, servers idle
            if i > 0 and i % 4 == 0:
                bandwidth.append(box_bandwidth())

        records = asyncio.run(interleaved_requests(targets, args, measure))
    bandwidth.append(box_bandwidth())
    first = next(iter(targets))
    summary = paired_summary(records, first)
    weights = {name: server.weights for name, (server, _) in targets.items()}
    for name in targets:
        results[name] = {
            "weights": weights[name], **summary[name],
            "requests": [r.to_dict() for r in records[name]],
        }  # fmt: skip
    bw = statistics.median(bandwidth)
    text = paired_table(summary, weights, bw, step_bytes, first)
    how = "each sent to every server in turn, one at a time; medians over prompts"
    print(f"\n{_run_line(bandwidth, args, how)}\n\n{text}")
    if args.out:
        _write(args, results, bandwidth, step_bytes, text)
    return 0


def bench_linear(args: argparse.Namespace) -> int:
    """kernels.cpu.linear against F.linear on the model's matrices, by input rows."""
    why = cpu.load()
    if why is not None:
        print(f"kernels.cpu unavailable: {why}")
        return 1
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    h, inter = cfg.hidden_size, cfg.hf["intermediate_size"]
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [(qkv, h), (h, cfg.num_heads * cfg.head_dim), (2 * inter, h), (h, inter)]
    weights = [torch.randn(n, k) for _ in range(cfg.num_layers) for n, k in shapes]
    nbytes = sum(w.numel() * 4 for w in weights)
    timer = Timer("cpu", repeats=7, warmup=1)
    print(f"{len(weights)} matrices, {nbytes / 1e6:.0f} MB; read bandwidth "
          f"{box_bandwidth() / 1e9:.1f} GB/s; {torch.get_num_threads()} threads")  # fmt: skip
    print("| rows | kernel ms | kernel GB/s | kernel GFLOP/s | F.linear ms | F.linear GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for _, k in shapes}
        ours = timer(lambda xs=xs: [cpu.linear(xs[w.shape[1]], Weight(w)) for w in weights])
        ref = timer(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights])
        flops = nbytes / 2 * m
        print(f"| {m} | {ours * 1e3:.1f} | {nbytes / ours / 1e9:.1f} | {flops / ours / 1e9:.1f} "
              f"| {ref * 1e3:.1f} | {flops / ref / 1e9:.1f} |")  # fmt: skip
    return 0


def _write(args, results, bandwidth, step_bytes, text: str) -> None:
    stamp = datetime.now(timezone.utc)
    command = "python -m bench.cpu " + " ".join(sys.argv[1:])
    meta = {
        "date": stamp.isoformat(timespec="seconds"), "command": command,
        "box": f"{os.cpu_count()} cores, {cpu_model()}", "torch": torch.__version__,
        "python": platform.python_version(), "read_bandwidth_gb_s": [b / 1e9 for b in bandwidth],
        "weight_bytes_per_step": step_bytes, "config": {k: v for k, v in vars(args).items()},
    }  # fmt: skip
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps({**meta, "results": results}, indent=2))
    md = [f"# CPU serving speed, {stamp:%Y-%m-%d}", "", f"- box: {meta['box']}",
          f"- torch {meta['torch']}, Python {meta['python']}", f"- command: `{command}`",
          f"- read bandwidth: {statistics.median(bandwidth) / 1e9:.1f} GB/s (median of "
          f"{len(bandwidth)}: {', '.join(f'{b / 1e9:.1f}' for b in bandwidth)})",
          "", text, ""]  # fmt: skip
    prefix.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {prefix}.md and .json")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=(*SERVERS, BASELINE))
    p.add_argument("--baseline", metavar="DIR",
                   help=f"source folder of another checkout, served as {BASELINE}")  # fmt: skip
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompts", type=int, default=16, help="requests per pass")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="servers in turn N times; medians")
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--kvserve-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the line goes to `kvserve serve`")  # fmt: skip
    p.add_argument("--log-dir", default="/tmp/kvserve-bench-cpu")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    p.add_argument("--interleave", action="store_true",
                   help="one stream, all servers up, each prompt sent to each in turn")  # fmt: skip
    p.add_argument("--linear", action="store_true", help="time the linear layers alone")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.linear:
        return bench_linear(args)
    return bench_interleaved(args) if args.interleave else bench_servers(args)


if __name__ == "__main__":
    sys.exit(main())
