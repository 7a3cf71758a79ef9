"""One command for a lent GPU: the CUDA tests, the kernel benchmarks, the decode step and a
served load test, into one results folder, in under 8 minutes of one device.

    python -m bench.gpu --out DIR [--budget 470] [--stages A B C D E F G]

Stages, each a subprocess with its own deadline (cut to what the budget has left; a stage that
fails or runs out is recorded and the next one runs):

  A  the CUDA tests: the Triton kernels (attention, KV formats, scores, block formats, norms,
     rotary, activation), CUDA graphs, memory profiling, step inputs, speculation and dtypes
     on every backend (with pytest-xdist over the cores where it is installed)
  B  ``bench.kernel_speed``: decode attention on the headline shapes against SDPA
  C  ``bench.decode_step``: SmolLM2-135M and the Qwen2.5-1.5B shape, batch 1, 8 and 64, eager
     and CUDA graphs (ms per step, launches per step from the profiler, roofline), and
     ``bench.kernel_count``'s offline count beside it
  D  ``bench.quant_speed``: the block-format GEMV and matmul against cuBLAS bf16
  E  served: random bf16 weights at the Qwen2.5-1.5B shape with a word-level tokenizer,
     ``kvserve serve`` on the device, ``bench.loadtest`` at concurrency 1, 8 and 64 (256
     tokens in, 128 out, ignore_eos)
  F  ``bench.step_profile``: a graphs decode step's wall time against its GPU kernel time,
     and the kernels that take it
  G  ``bench.step_profile --host``: where the host's time goes at the served shape under a
     load of mixed steps (Python's profiler), batch 64

``DIR/summary.txt`` holds the device and versions, then per stage its command, deadline, exit
code and the last lines of its output; each stage's whole log and result files lie beside it.
The last lines printed are the summary's table of stages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = [
    *(f"tests/kernels/{name}.py" for name in (
        "test_attention", "test_triton_kv", "test_triton_scores", "test_triton_quant",
        "test_triton_norm", "test_triton_rope", "test_triton_act", "test_rotary")),
    *(f"tests/engine/worker/{name}.py" for name in (
        "test_cuda_graphs", "test_memory", "test_step_inputs")),
    "tests/engine/test_speculative_backends.py", "tests/engine/test_dtypes.py",
]  # fmt: skip
# Seconds each stage may take at most; the whole run fits in --budget.
DEADLINES = {"A": 240, "B": 60, "C": 120, "D": 45, "E": 90, "F": 120, "G": 90}
MIN_STAGE_S = 10  # a stage left less than this by the budget is skipped
SERVED = "qwen2.5-1.5b"
CONCURRENCY = (1, 8, 64)


def stage_commands(out: Path) -> dict[str, tuple[str, list[str]]]:
    """What each stage runs: (title, command)."""
    py = sys.executable
    xdist = ["-p", "xdist", "-n", str(min(12, os.cpu_count() or 1))] if _has("xdist") else []
    return {
        "A": ("CUDA tests", [py, "-m", "pytest", "-q", "-rfE", *xdist, *CUDA_TESTS]),
        "B": ("kernel_speed", [py, "-m", "bench.kernel_speed", "--out", f"{out}/B_kernel_speed"]),
        "C": ("decode_step and kernel_count", [py, "-m", "bench.gpu", "--stage-c", str(out)]),
        "D": ("quant_speed", [py, "-m", "bench.quant_speed", "--out", f"{out}/D_quant_speed"]),
        "E": ("served load test", [py, "-m", "bench.gpu", "--stage-e", str(out)]),
        "F": ("step profile", [py, "-m", "bench.step_profile", "--out", f"{out}/F_step_profile"]),
        "G": ("host profile", [py, "-m", "bench.step_profile", "--host", "--models", SERVED,
                               "--batch", "64", "--top", "40", "--out", f"{out}/G_host_profile"]),
    }  # fmt: skip


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def facts() -> str:
    """The device and the versions it ran with."""
    import torch

    lines = [f"date {datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
             f"python {platform.python_version()} | torch {torch.__version__}"]  # fmt: skip
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"device {p.name}, {p.total_memory / 2**30:.0f} GiB, "
                     f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")  # fmt: skip
    else:
        lines.append("no CUDA device")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip()  # fmt: skip
    lines.append(f"checkout {rev or 'unknown'} | cores {os.cpu_count()}")
    return "\n".join(lines)


def run_stages(out: Path, stages: list[str], budget: float) -> list[dict]:
    """Each stage in turn under its deadline; its log under ``out``, its summary appended to
    ``out/summary.txt`` as it ends (a run cut short keeps what it had)."""
    commands = stage_commands(out)
    summary = out / "summary.txt"
    summary.write_text(facts() + "\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start, results = time.monotonic(), []
    for stage in stages:
        title, command = commands[stage]
        deadline = min(DEADLINES[stage], budget - (time.monotonic() - start))
        if deadline < MIN_STAGE_S:
            results.append(dict(stage=stage, title=title, rc="skipped: budget spent", s=0))
            continue
        begun = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True,
                                  timeout=deadline)  # fmt: skip
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            rc = f"timed out after {deadline:.0f} s"
            text = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                           for x in (exc.stdout, exc.stderr))  # fmt: skip
        seconds = time.monotonic() - begun
        (out / f"{stage}.log").write_text(text)
        results.append(dict(stage=stage, title=title, rc=rc, s=round(seconds, 1)))
        with summary.open("a") as f:
            f.write(f"\n== {stage} {title} (deadline {deadline:.0f} s)\n$ {' '.join(command)}\n"
                    f"{_tail(text)}\n-- rc={rc} after {seconds:.0f} s\n")  # fmt: skip
    table = ["| stage | what | rc | s |", "|---|---|---|---|"]
    table += [f"| {r['stage']} | {r['title']} | {r['rc']} | {r['s']} |" for r in results]
    with summary.open("a") as f:
        f.write("\n" + "\n".join(table) + "\n")
    print(_tail(summary.read_text(), 12 + len(results)))
    return results


def stage_c(out: Path) -> int:
    """The decode step on the device, and the offline kernel count of the same shapes."""
    from bench import decode_step, kernel_count

    rc = decode_step.main(["--models", "smollm2-135m", SERVED, "--batch", "1", "8", "64",
                           "--repeats", "2", "--out", str(out / "C_decode_step")])  # fmt: skip
    kernel_count.main(["--models", "smollm2-135m", SERVED, "--out", str(out / "C_kernel_count")])
    return rc


def word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json of ``vocab`` words (``w0`` ...), whitespace-split, so that
    a random-weight checkpoint can be served: the load tester's words map to unknown ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))


def stage_e(out: Path) -> int:
    """``kvserve serve`` over random weights at the served shape, driven at each concurrency."""
    from bench import cpu
    from bench.decode_step import SHAPES, build_checkpoint

    folder = build_checkpoint(SERVED, out / "checkpoint")
    word_tokenizer(folder, SHAPES[SERVED][2]["vocab_size"])
    port = 8765
    # The CLI as a module: a device image may run the checkout without installing it.
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(folder),
               "--served-model-name", "kvserve", "--host", "127.0.0.1", "--port", str(port),
               "--device", "cuda", "--max-model-len", "4096"]  # fmt: skip
    server = cpu.Server("kvserve", "kvserve", "bf16", command)
    rows = []
    with cpu.started(server, port, out) as root:
        if root is None:
            print(f"the server did not start: {out / 'kvserve.log'}")
            return 1
        for c in CONCURRENCY:
            config = cpu.BenchConfig(
                base_url=root + "/v1", model="kvserve", num_prompts=max(8, 4 * c),
                max_concurrency=c, input_len=256, output_len=128, ignore_eos=True,
                scrape_interval_s=0, seed=c,
            )  # fmt: skip
            s = asyncio.run(cpu.run_benchmark(config)).summary
            rows.append(dict(concurrency=c, completed=s.completed, failed=s.failed,
                             ttft_ms=s.ttft.median_ms, tpot_ms=s.tpot.median_ms,
                             output_tok_s=s.output_throughput))  # fmt: skip
    lines = ["| concurrency | ok | failed | TTFT p50 ms | TPOT p50 ms | output tok/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['concurrency']} | {r['completed']} | {r['failed']} | {r['ttft_ms']:.1f} "
              f"| {r['tpot_ms']:.2f} | {r['output_tok_s']:.0f} |" for r in rows]  # fmt: skip
    text = f"{SERVED} shape, random bf16 weights, 256 in / 128 out\n\n" + "\n".join(lines)
    print(text)
    (out / "E_serve.md").write_text(text + "\n")
    (out / "E_serve.json").write_text(json.dumps(rows, indent=1) + "\n")
    return int(any(r["failed"] for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="the results folder (made if absent)")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all stages")
    parser.add_argument("--stages", nargs="+", default=list(DEADLINES), choices=list(DEADLINES))
    parser.add_argument("--stage-c", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage-e", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage_c:
        return stage_c(args.stage_c)
    if args.stage_e:
        return stage_e(args.stage_e)
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_stages(args.out.resolve(), args.stages, args.budget)
    return int(any(r["rc"] != 0 for r in results))


if __name__ == "__main__":
    raise SystemExit(main())
