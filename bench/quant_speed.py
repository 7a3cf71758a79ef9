"""Block-format matrix products on a GPU (``kernels.triton_quant``) beside cuBLAS bf16.

    python -m bench.quant_speed [--formats q4_k q6_k q8_0] [--rows 1 64] [--out PREFIX]
        [--gemv-tiles BN:BK:WARPS:STAGES ...] [--matmul-tiles BM:BN:BK:WARPS:STAGES ...]

Qwen2.5-1.5B's shapes (gate_up 17920 x 1536, down 1536 x 8960, the 151936-row LM head), random
weights of each format (``kernels.quant.random_blocks``) through the ``triton`` backend's module
(the GEMV at one row, the matmul above), against ``F.linear`` over bf16 weights of the same
shape. Per format, rows and matrix: median µs (``bench.kernel_speed.Timer``: graphs of calls
after L2 flushes), weight GB/s (the stored bytes over the time) and its fraction of the device's
measured read bandwidth, the time against bf16's, and the result's largest error against the
dequantized product over that product's largest value (a product that is wrong stops the run).
``--gemv-tiles`` and ``--matmul-tiles`` time each given tile too (the GEMV's rows are the step's,
rounded up to a power of 2), in rows of their own after the default's; a tile that does not
compile for the device is reported as such.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernel_speed import Timer, read_bandwidth
from kernels.launch import run
from kernels.quant import QuantLinear, dequantize, random_blocks
from kernels.weights import Weight

SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}
SMOKE = {"gate_up": (64, 256)}  # --smoke: the code path on the CPU, under the interpreter
# Relative to the product's largest value: bf16 activations and fp32 sums over 9k products.
MAX_ERROR = 2e-2


def measure(
    fmt: str, rows: int, name: str, timer: Timer, bandwidth: float, shapes=SHAPES, tiles=()
) -> list[dict]:
    """The default's row, then one per tile of ``tiles``."""
    n, k = shapes[name]
    device = timer.device
    stored = Weight(random_blocks(fmt, n, k, seed=n + k, size=0.05), None, fmt)
    dense = dequantize(stored).to(device, torch.bfloat16)  # gguf-py's, on the host
    data = stored.data.to(device)
    module = torch.nn.ModuleList([QuantLinear((Weight(data, None, fmt),))])
    from kernels.backend import TritonBackend  # imports triton: after --smoke's TRITON_INTERPRET

    TritonBackend().prepare(module)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    expected = F.linear(x.float(), dense.float())
    bf16 = timer(lambda: F.linear(x, dense))
    weight_bytes = data.numel() * data.element_size()
    found = []
    for tile in (None, *tiles):
        fn = module[0] if tile is None else functools.partial(_with_tile, parts=module[0].parts,
                                                              tile=tile)  # fmt: skip
        row = dict(format=fmt, rows=rows, matrix=name, n=n, k=k, mib=weight_bytes / 2**20,
                   tile=_tile_name(tile), bf16_us=bf16 * 1e6)  # fmt: skip
        try:
            got = fn(x)
        except Exception as e:  # a swept tile the device cannot compile (registers, shared)
            if tile is None:
                raise
            found.append(row | dict(error=None, failed=str(e).splitlines()[0][:80]))
            continue
        error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
        if not error <= MAX_ERROR:
            raise SystemExit(f"{fmt} {name} x {rows} rows {row['tile']}: error {error:.3g}")
        seconds = timer(lambda fn=fn: fn(x))
        found.append(row | dict(us=seconds * 1e6, gbs=weight_bytes / seconds / 1e9,
                                of_read=weight_bytes / seconds / bandwidth,
                                vs_bf16=bf16 / seconds, error=error))  # fmt: skip
    return found


def _with_tile(x: torch.Tensor, parts, tile) -> torch.Tensor:
    from kernels import triton_quant  # after --smoke has set TRITON_INTERPRET

    out, launches = triton_quant.linear_launches(x, parts, tile=tile)
    run(launches)
    return out


def _tile_name(tile) -> str:
    if tile is None:
        return "default"
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def parse_tiles(specs: list[str], rows: int | None) -> list:
    """``BN:BK:W:S`` (a GEMV's, its rows ``rows`` rounded up) or ``BM:BN:BK:W:S``."""
    from kernels import triton_quant

    tiles = []
    for spec in specs:
        v = [int(n) for n in spec.split(":")]
        if rows is not None:
            v = [1 << (rows - 1).bit_length(), *v]
        tiles.append(triton_quant.Tile(*v))
    return tiles


def markdown(rows: list[dict], bandwidth: float) -> str:
    lines = [
        "| format | rows | matrix | tile | N x K | MiB | µs | weight GB/s | of read BW | bf16 µs "
        "| vs bf16 | max error |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        what = f"| {r['format']} | {r['rows']} | {r['matrix']} | {r['tile']} | {r['n']} x {r['k']} "
        if r["error"] is None:
            lines.append(f"{what}| {r['mib']:.2f} | does not compile: {r['failed']} |||||")
            continue
        lines.append(
            f"{what}| {r['mib']:.2f} | {r['us']:.1f} | {r['gbs']:.0f} | {r['of_read']:.0%} "
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
    parser.add_argument("--gemv-tiles", nargs="*", default=[], metavar="BN:BK:W:S")
    parser.add_argument("--matmul-tiles", nargs="*", default=[], metavar="BM:BN:BK:W:S")
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
    from kernels import triton_quant  # after --smoke has set TRITON_INTERPRET

    results = []
    for fmt in args.formats:
        for name in args.matrices if not args.smoke else list(SMOKE):
            for rows in args.rows:
                gemv = rows <= triton_quant.GEMV_ROWS
                tiles = parse_tiles(args.gemv_tiles if gemv else args.matmul_tiles,
                                    rows if gemv else None)  # fmt: skip
                results += measure(fmt, rows, name, timer, bandwidth, shapes, tiles)
    text = markdown(results, bandwidth)
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(f"# Block-format products, {timer.device}\n\n{text}\n")
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
