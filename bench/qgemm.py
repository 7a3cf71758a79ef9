"""The CPU kernels' block-format products against the machine's peak, by format and row count.

    python -m bench.qgemm [--rows 1 2 4 8 16 64 512] [--formats q4_k q6_k ...] [--k 1536]
        [--n 2048] [--threads 2] [--layouts packed file] [--out PREFIX]

Measures the peak rate of int8 multiply-adds of each instruction-set build
(``kernels.cpu.int8_peak``: its multiply instruction on registers, every thread, best of a few
tries) and the memory read bandwidth, then times ``kernels.cpu.linear`` on an [N, K] matrix of
random weights in each format (``kernels.quant.random_blocks``) for each row count (median of
repeats, after a warm-up), in each layout: ``packed`` (repacked at load, what the engine
serves by default) and ``file`` (as the GGUF file stores it, ``--no-repack-weights``). Per
format, layout and rows: G multiply-adds per second achieved, their fraction of the peak, and
the weight bytes read per second (the roofline of one row). ``dense`` is the float32 path,
against the same byte peak for scale. Results go to PREFIX.md / .json with the box and the date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.cpu import box_bandwidth, cpu_model
from kernels import cpu
from kernels.quant import random_blocks
from kernels.weights import FORMATS, Weight

ROWS = (1, 2, 4, 8, 16, 64, 512)


def median_seconds(fn, repeats: int, budget_s: float = 1.0) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < budget_s and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def weight_of(fmt: str, n: int, k: int, layout: str) -> Weight:
    if fmt == "dense":
        return Weight(torch.randn(n, k) * 0.02)
    w = Weight(random_blocks(fmt, n, k, seed=0, size=0.02), format=fmt)
    return cpu.repacked(w)[0] if layout == "packed" else w


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    isa = cpu.chosen_isa()
    peaks = {i: max(cpu.int8_peak(isa=i) for _ in range(3)) for i in cpu.isas()}
    bandwidth = box_bandwidth()
    rows = []
    for fmt in args.formats:
        for layout in args.layouts if fmt != "dense" else ["file"]:
            w = weight_of(fmt, args.n, args.k, layout)
            nbytes = w.data.numel() * w.data.element_size()
            for m in args.rows:
                x = torch.randn(m, args.k)
                seconds = median_seconds(lambda x=x, w=w: cpu.linear(x, w), args.repeats)
                macs = m * args.n * args.k / seconds
                row = dict(format=fmt, layout=layout, rows=m, ms=seconds * 1e3,
                           gmacs=macs / 1e9, of_peak=macs / peaks[isa],
                           weight_gbs=nbytes / seconds / 1e9)  # fmt: skip
                rows.append(row)
                print(f"{fmt:>6} {layout:>6} rows {m:>4}: {seconds * 1e3:8.3f} ms "
                      f"{macs / 1e9:7.1f} G MAC/s {100 * macs / peaks[isa]:5.1f}% of peak  "
                      f"{nbytes / seconds / 1e9:6.1f} GB/s of weights", flush=True)  # fmt: skip
    return dict(
        box=cpu_model(), isa=isa, threads=args.threads, k=args.k, n=args.n,
        peak_gmacs={i: p / 1e9 for i, p in peaks.items()}, read_gbs=bandwidth / 1e9,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), results=rows,
    )  # fmt: skip


def markdown(report: dict, command: str) -> str:
    peaks = ", ".join(f"{i} {p:.0f}" for i, p in report["peak_gmacs"].items())
    lines = [
        f"# Block-format products, {report['date']}",
        "",
        f"Box: {report['box']}, {report['threads']} threads, build `{report['isa']}`. "
        f"Peak int8 G MAC/s (registers only): {peaks}. Memory read: "
        f"{report['read_gbs']:.1f} GB/s. Matrix [N={report['n']}, K={report['k']}].",
        "",
        f"Command: `{command}`",
        "",
        "| format | layout | rows | ms | G MAC/s | % of peak | weight GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['format']} | {r['layout']} | {r['rows']} | {r['ms']:.3f} | {r['gmacs']:.1f} | "
            f"{100 * r['of_peak']:.1f}% | {r['weight_gbs']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a products benchmark: layouts, threads, repeats, where results go."""
    p.add_argument("--layouts", nargs="+", default=["packed", "file"], choices=["packed", "file"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")


def require_kernels() -> None:
    why = cpu.load()
    if why is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.qgemm", description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--k", type=int, default=1536, help="inputs (a multiple of 256)")
    p.add_argument("--n", type=int, default=2048, help="outputs")
    add_run_arguments(p)
    args = p.parse_args(argv)
    require_kernels()
    if args.k % 256:
        raise SystemExit(f"--k {args.k}: a multiple of 256 (the K formats' block)")
    report = run(args)
    if args.out:
        command = "python -m bench.qgemm " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(args.out + ".md").write_text(markdown(report, command.strip()))


if __name__ == "__main__":
    main()
