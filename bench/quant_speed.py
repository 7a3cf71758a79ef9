"""Block-format matrix products on a GPU (``kernels.triton_quant``) beside cuBLAS bf16.

    python -m bench.quant_speed [--formats q4_k q6_k q8_0] [--rows 1 64] [--out PREFIX]

Qwen2.5-1.5B's shapes (gate_up 17920 x 1536, down 1536 x 8960, the 151936-row LM head), random
weights of each format (``kernels.quant.random_blocks``) through the ``triton`` backend's module
(the GEMV at one row, the matmul above), against ``F.linear`` over bf16 weights of the same
shape. Per format, rows and matrix: median µs (``bench.kernel_speed.Timer``: graphs of calls
after L2 flushes), weight GB/s (the stored bytes over the time) and its fraction of the device's
measured read bandwidth, the time against bf16's, and the result's largest error against the
dequantized product over that product's largest value (a product that is wrong stops the run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernel_speed import Timer, read_bandwidth
from kernels.backend import TritonBackend
from kernels.quant import QuantLinear, dequantize, random_blocks
from kernels.weights import Weight

SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}
SMOKE = {"gate_up": (64, 256)}  # --smoke: the code path on the CPU, under the interpreter
# Relative to the product's largest value: bf16 activations and fp32 sums over 9k products.
MAX_ERROR = 2e-2


def measure(fmt: str, rows: int, name: str, timer: Timer, bandwidth: float, shapes=SHAPES) -> dict:
    n, k = shapes[name]
    device = timer.device
    stored = Weight(random_blocks(fmt, n, k, seed=n + k, size=0.05), None, fmt)
    dense = dequantize(stored).to(device, torch.bfloat16)  # gguf-py's, on the host
    data = stored.data.to(device)
    module = torch.nn.ModuleList([QuantLinear((Weight(data, None, fmt),))])
    TritonBackend().prepare(module)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    got = module[0](x)
    expected = F.linear(x.float(), dense.float())
    error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
    if not error <= MAX_ERROR:
        raise SystemExit(f"{fmt} {name} x {rows} rows: error {error:.3g} over {MAX_ERROR}")
    seconds = timer(lambda: module[0](x))
    bf16 = timer(lambda: F.linear(x, dense))
    weight_bytes = data.numel() * data.element_size()
    return dict(format=fmt, rows=rows, matrix=name, n=n, k=k, mib=weight_bytes / 2**20,
                us=seconds * 1e6, gbs=weight_bytes / seconds / 1e9,
                of_read=weight_bytes / seconds / bandwidth, bf16_us=bf16 * 1e6,
                vs_bf16=bf16 / seconds, error=error)  # fmt: skip


def markdown(rows: list[dict], bandwidth: float) -> str:
    lines = [
        "| format | rows | matrix | N x K | MiB | µs | weight GB/s | of read BW | bf16 µs "
        "| vs bf16 | max error |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['rows']} | {r['matrix']} | {r['n']} x {r['k']} "
            f"| {r['mib']:.2f} | {r['us']:.1f} | {r['gbs']:.0f} | {r['of_read']:.0%} "
            f"| {r['bf16_us']:.1f} | {r['vs_bf16']:.2f}x | {r['error']:.1e} |"
        )
    lines.append(f"\nRead bandwidth (a sum over random floats): {bandwidth / 1e9:.0f} GB/s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_speed", description=__doc__)
    parser.add_argument("--formats", nargs="+", default=["q4_k", "q6_k", "q8_0"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--matrices", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny shape on the CPU (interpreter)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        timer, shapes = Timer("cpu", repeats=1, warmup=0), SMOKE
        bandwidth = read_bandwidth(timer, "cpu", 2**20)
    elif torch.cuda.is_available():
        timer, shapes = Timer("cuda", repeats=args.repeats, warmup=3), SHAPES
        bandwidth = read_bandwidth(timer, "cuda", 2**30)
    else:
        print("bench.quant_speed needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    results = [
        measure(fmt, rows, name, timer, bandwidth, shapes)
        for fmt in args.formats
        for name in (args.matrices if not args.smoke else list(SMOKE))
        for rows in args.rows
    ]
    text = markdown(results, bandwidth)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(f"# Block-format products, {timer.device}\n\n{text}\n")
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
