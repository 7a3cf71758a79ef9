"""The block-format products of one decode step of a Q4_K_M model, read from memory, against
the machine's read bandwidth: is one row at the weight-read roofline, and what do more rows
(a batch, a speculative verify) cost beside it?

    python -m bench.step_products [--rows 1 5 8] [--layouts packed file] [--threads 2]
        [--repeats 5] [--out PREFIX]

The matrices have the shapes and formats of Qwen2.5-Coder-1.5B-Instruct Q4_K_M (28 layers:
q|k|v, o, gate|up in Q4_K, v and down in Q6_K every other layer, the LM head in Q6_K; 980 MB,
far more than the caches), filled with random blocks (``kernels.quant.random_blocks``). A step
multiplies each matrix once, in order, by ``rows`` input rows (``kernels.cpu.linear``), as the
fused layers do; attention, norms and sampling are left out. Per row count and layout (``packed``:
repacked at load, what the engine serves; ``file``: ``--no-repack-weights``): the median step
time, the weight bytes read per second and their fraction of the read bandwidth (measured
before and after), and the step's cost against one row's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.cpu import box_bandwidth, cpu_model
from bench.qgemm import add_run_arguments, median_seconds, require_kernels
from kernels import cpu
from kernels.quant import random_blocks
from kernels.weights import Parts, Weight


@dataclass(frozen=True)
class Shape:
    layers: int = 28
    hidden: int = 1536
    ffn: int = 8960
    kv: int = 256  # k and v rows each (2 heads of 128)
    vocab: int = 151936


def matrices(shape: Shape) -> list[Parts]:
    """The step's matrices in the order a step reads them, as Q4_K_M stores them."""
    h, out = shape.hidden, []
    for layer in range(shape.layers):
        v = "q6_k" if layer % 2 else "q4_k"  # Q4_K_M: every other layer's v and down in Q6_K
        pieces = [
            (("q4_k", h + shape.kv, h), (v, shape.kv, h)),
            (("q4_k", h, h),),
            (("q4_k", 2 * shape.ffn, h),),
            ((v, h, shape.ffn),),
        ]
        for parts in pieces:
            out.append(tuple(
                Weight(random_blocks(f, n, k, seed=len(out)), None, f) for f, n, k in parts
            ))  # fmt: skip
    out.append((Weight(random_blocks("q6_k", shape.vocab, h, seed=len(out)), None, "q6_k"),))
    return out


def step_seconds(mats: list[Parts], rows: int, repeats: int) -> float:
    xs = {m[0].in_features: torch.randn(rows, m[0].in_features) for m in mats}

    def step() -> None:
        for m in mats:
            cpu.linear(xs[m[0].in_features], m)

    return median_seconds(step, repeats, budget_s=0.0)


def run(rows: list[int], layouts: list[str], repeats: int, shape: Shape = Shape()) -> dict:
    file = matrices(shape)
    by_layout = {"file": file, "packed": [cpu.repacked(m) for m in file]}
    nbytes = sum(p.data.numel() for m in file for p in m)
    bandwidth = [box_bandwidth()]
    results = []
    for layout in layouts:
        one = None
        for r in rows:
            s = step_seconds(by_layout[layout], r, repeats)
            one = s if r == 1 else one
            results.append(dict(layout=layout, rows=r, ms=s * 1e3, weight_gbs=nbytes / s / 1e9,
                                of_one_row=s / one if one else None))  # fmt: skip
            print(f"{layout:>6} rows {r:>3}: {s * 1e3:7.1f} ms per step, "
                  f"{nbytes / s / 1e9:5.1f} GB/s of weights", flush=True)  # fmt: skip
    bandwidth.append(box_bandwidth())
    return dict(
        box=cpu_model(), threads=torch.get_num_threads(), weight_mb=nbytes / 1e6,
        read_gbs=[b / 1e9 for b in bandwidth], results=results,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )  # fmt: skip


def markdown(report: dict, command: str) -> str:
    low, high = min(report["read_gbs"]), max(report["read_gbs"])
    lines = [
        f"# One decode step's products, Qwen2.5-Coder-1.5B Q4_K_M shapes, {report['date']}",
        "",
        f"Box: {report['box']}, {report['threads']} threads. Weights {report['weight_mb']:.0f} MB "
        f"per step. Read bandwidth {low:.1f}-{high:.1f} GB/s (before and after).",
        "",
        f"Command: `{command}`",
        "",
        "| layout | rows | ms per step | weight GB/s | of read bandwidth (high-low) | x one row |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        ratio = f"{r['of_one_row']:.2f}" if r["of_one_row"] else "-"
        lines.append(
            f"| {r['layout']} | {r['rows']} | {r['ms']:.1f} | {r['weight_gbs']:.1f} | "
            f"{100 * r['weight_gbs'] / high:.0f}-{100 * r['weight_gbs'] / low:.0f}% | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.step_products", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rows", nargs="+", type=int, default=[1, 5, 8])
    add_run_arguments(p)
    args = p.parse_args(argv)
    require_kernels()
    torch.set_num_threads(args.threads)
    report = run(args.rows, args.layouts, args.repeats)
    if args.out:
        command = "python -m bench.step_products " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(args.out + ".md").write_text(markdown(report, command.strip()))


if __name__ == "__main__":
    main()
