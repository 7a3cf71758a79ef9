"""Paged decode attention benchmark: ``python -m bench.kernel_speed [--out PREFIX]``.

Per shape: median time over repeats (CUDA events, L2 flushed before each), the K/V bytes the
kernel must read divided by that time, and that bandwidth as a fraction of a device-to-device
copy measured in the same run (copy GB/s counts read + write bytes). Next to it: torch SDPA over
K/V gathered beforehand into dense tensors (the gather is not timed: a bound, not a paged
kernel), and FlashInfer / flash-attn when importable.

``--kv`` names the KV dtypes of the caches (default: ``--dtype``'s), each shape run over each:
a quantized one (int8, fp8_e4m3, int4: ``kernels.kv_quant``) under a query of ``--dtype`` reads
the quantized rows (scales included: the bytes counted), SDPA the dequantized rows in
``--dtype``; the "vs first" column is the first KV dtype's time for the shape over this one's.

``--smoke`` runs tiny shapes on the CPU through the torch backend, to show the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import kv_quant, reference
from models.kv_spec import QUANTIZED_KV, row_bytes

# Query heads, KV heads, Dk, Dv: Llama-3-8B, SmolLM2-135M, Gemma 3 270M (global and window).
GQA_LAYOUTS = ((32, 8, 128, 128), (9, 3, 64, 64), (4, 1, 256, 256))
MLA_LAYOUT = (128, 1, 576, 512)
BATCH_CONTEXTS = ((1, 1024), (1, 32768), (16, 4096), (64, 1024), (64, 4096))
WINDOW_CASES = ((1, 32768), (16, 4096), (16, 32768))
WINDOW = 512


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    dk: int
    dv: int
    window: int = 0
    mla: bool = False  # v is the first dv columns of the k cache

    @property
    def name(self) -> str:
        kind = "mla" if self.mla else f"{self.num_heads}/{self.num_kv_heads}/{self.dk}"
        win = f" w{self.window}" if self.window else ""
        return f"{kind} {self.batch}x{_tokens(self.context)}{win}"

    @property
    def attended(self) -> int:
        return min(self.context, self.window) if self.window else self.context

    def kv_bytes(self, k_row: int, v_row: int) -> int:
        """Bytes a decode step must read: each attended token's K and V rows once (MLA: the
        key's row, the value a prefix of it), rows of ``k_row`` and ``v_row`` bytes."""
        width = k_row if self.mla else k_row + v_row
        return self.batch * self.attended * self.num_kv_heads * width


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def full_shapes() -> list[Shape]:
    shapes = [Shape(b, c, *layout) for layout in GQA_LAYOUTS for b, c in BATCH_CONTEXTS]
    shapes += [Shape(b, c, *MLA_LAYOUT, mla=True) for b, c in BATCH_CONTEXTS]
    shapes += [Shape(b, c, *layout, window=WINDOW) for layout in (GQA_LAYOUTS[0], GQA_LAYOUTS[2])
               for b, c in WINDOW_CASES]  # fmt: skip
    return shapes


def smoke_shapes() -> list[Shape]:
    return [
        Shape(2, 64, 4, 2, 32, 32),
        Shape(1, 100, 6, 2, 16, 16),
        Shape(2, 40, 8, 1, 72, 64, mla=True),
        Shape(2, 64, 4, 2, 32, 32, window=16),
        Shape(2, 256, 4, 2, 32, 32, window=16),
    ]


@dataclass
class Case:
    """One decode step's inputs over a paged cache with shuffled physical blocks."""

    shape: Shape
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # a ring of ceil(window / bs) + 1 blocks when windowed
    seq_lens: torch.Tensor
    block_size: int

    @property
    def scale(self) -> float:
        return self.shape.dk**-0.5

    def kv_bytes(self) -> int:
        row = lambda cache: cache.shape[-1] * cache.element_size()  # noqa: E731
        return self.shape.kv_bytes(row(self.k_cache), row(self.v_cache))

    def logical_tables(self) -> torch.Tensor:
        """Table over all logical blocks of the context (the ring repeated when windowed)."""
        width = math.ceil(self.shape.context / self.block_size)
        return self.tables[:, torch.arange(width, device=self.tables.device) % self.tables.shape[1]]

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of the attended positions in the query's dtype (what a dense-cache
        baseline reads): [B, Hkv, L, D]."""
        s = self.shape
        pos = torch.arange(s.context - s.attended, s.context, device=self.q.device)
        ks, vs = [], []
        for table in self.tables:
            ks.append(reference.gather_cache(self.k_cache, table, pos, s.window))
            vs.append(reference.gather_cache(self.v_cache, table, pos, s.window))
        dtype = self.q.dtype
        return torch.stack(ks).transpose(1, 2).to(dtype), torch.stack(vs).transpose(1, 2).to(dtype)


def build_case(
    shape: Shape, block_size: int, dtype: torch.dtype, device: str, kv: str = ""
) -> Case:
    """The step's inputs; the caches in the KV dtype ``kv`` when it is a quantized one,
    written from the same random rows as the ``dtype`` cache."""
    gen = torch.Generator(device=device).manual_seed(0)
    if shape.window:
        width = math.ceil(shape.window / block_size) + 1
    else:
        width = math.ceil(shape.context / block_size)
    num_blocks = shape.batch * width
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(shape.batch, width)
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.dk)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    if shape.mla:
        v_cache = k_cache[..., : shape.dv]
    else:
        v_shape = (*cache_shape[:3], shape.dv)
        v_cache = torch.randn(v_shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(shape.batch, shape.num_heads, shape.dk, generator=gen, device=device)
    stored = kv_quant.KV_DTYPES.get(kv)
    if stored in kv_quant.QUANTIZED:
        k_cache = kv_quant.quantize(k_cache, stored)
        if shape.mla:  # the value is the rows' first dv values: a prefix of each stored row
            v_cache = k_cache[..., : row_bytes(kv, shape.dv)]  # one-byte elements
        else:
            v_cache = kv_quant.quantize(v_cache, stored)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    return Case(shape, q.to(dtype), k_cache, v_cache, tables.int(), seq_lens, block_size)


class Timer:
    """Median time of one call. On CUDA: ``calls`` calls captured in one CUDA graph, each after
    an L2 flush, against the same graph of flushes alone, replayed alternately (so clock
    changes hit both); neither launch overhead nor a warm L2 counts."""

    def __init__(self, device: str, repeats: int, warmup: int, flush: bool = True, calls=10):
        self.device, self.repeats, self.warmup, self.calls = device, repeats, warmup, calls
        self.flush_buffer = None
        if device.startswith("cuda") and flush:
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        """Seconds."""
        if not self.device.startswith("cuda"):
            for _ in range(self.warmup):
                fn()
            return statistics.median(_wall(fn) for _ in range(self.repeats))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, self.warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs = [self._capture(fn), self._capture(None)]
        for g in graphs:
            g.replay()
        times: list[list[float]] = [[], []]
        for _ in range(self.repeats):
            for g, t in zip(graphs, times):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                t.append(start.elapsed_time(end) / 1e3 / self.calls)
        return max(1e-9, statistics.median(times[0]) - statistics.median(times[1]))

    def eager(self, fn: Callable[[], object]) -> float:
        """Seconds of one call timed alone with events: for calls of a gigabyte, where neither
        launch overhead nor L2 matters."""
        if not self.device.startswith("cuda"):
            return self(fn)
        for _ in range(max(1, self.warmup)):
            fn()
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def _capture(self, fn: Callable[[], object] | None) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.calls):
                if self.flush_buffer is not None:
                    self.flush_buffer.zero_()
                if fn is not None:
                    fn()
        return graph


def _wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(timer: Timer, device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting both the read and the write."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer.eager(lambda: dst.copy_(src))


def read_bandwidth(timer: Timer, device: str, nbytes: int) -> float:
    """Bytes per second of a sum over random floats: a read-only roofline (decode only reads)."""
    src = torch.randn(nbytes // 4, device=device)
    return nbytes / timer.eager(lambda: src.sum())


# Candidates: each takes a Case and returns a zero-argument callable giving [B, Hq, Dv], or
# raises to say it cannot run the shape.


def _kernel_under_test(case: Case, num_splits: int | None, tile=None) -> Callable[[], torch.Tensor]:
    args = (case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens, case.scale)
    if case.q.is_cuda:
        from kernels import triton_attention

        return lambda: triton_attention.decode_attention(
            *args, case.shape.window, num_splits=num_splits, tile=tile
        )
    return lambda: reference.decode_attention(*args, case.shape.window)


def _sdpa(case: Case) -> Callable[[], torch.Tensor]:
    k, v = case.gathered()  # [B, Hkv, L, D]
    b, hq, d = case.q.shape
    hk = k.shape[1]
    # Each key head's group of query heads as the rows of one query: SDPA then reads the
    # shared K/V once, where enable_gqa copies them per query head (72 GiB for MLA, 64 x 4k).
    q = case.q.view(b, hk, hq // hk, d)
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=case.scale).reshape(b, hq, -1)


def _flashinfer(case: Case) -> Callable[[], torch.Tensor]:
    import flashinfer

    s = case.shape
    if s.mla:
        raise NotImplementedError("MLA decode has its own FlashInfer wrapper; not wired here")
    bs = case.block_size
    first, last = (s.context - s.attended) // bs, (s.context - 1) // bs
    pages = case.logical_tables()[:, first : last + 1]
    indptr = torch.arange(s.batch + 1, dtype=torch.int32, device=case.q.device) * pages.shape[1]
    last_len = torch.full_like(case.seq_lens, (s.context - 1) % bs + 1)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=case.q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        indptr, pages.reshape(-1).contiguous(), last_len, s.num_heads, s.num_kv_heads, s.dk, bs,
        window_left=s.window - 1 if s.window else -1, q_data_type=case.q.dtype,
        kv_data_type=case.k_cache.dtype, sm_scale=case.scale,
    )  # fmt: skip
    return lambda: wrapper.run(case.q, (case.k_cache, case.v_cache))


def _flash_attn(case: Case) -> Callable[[], torch.Tensor]:
    from flash_attn import flash_attn_with_kvcache

    s = case.shape
    if s.mla or s.dk != s.dv:
        raise NotImplementedError("flash-attn needs Dk == Dv")
    if case.block_size % 256:
        raise NotImplementedError("flash-attn pages must be multiples of 256 (--block-size)")
    q = case.q.unsqueeze(1)  # [B, 1, Hq, D]
    window = (s.window - 1, 0) if s.window else (-1, -1)
    tables = case.logical_tables().contiguous()
    return lambda: flash_attn_with_kvcache(
        q, case.k_cache, case.v_cache, cache_seqlens=case.seq_lens, block_table=tables,
        softmax_scale=case.scale, causal=True, window_size=window,
    ).squeeze(1)  # fmt: skip


@dataclass
class Row:
    shape: str
    kv: str
    kv_mib: float
    num_splits: int | None
    us: float
    gbs: float
    copy_frac: float
    read_frac: float
    best_us: float | None  # --sweep: the fastest tile and split count tried
    best: str
    sdpa_us: float | None
    flashinfer_us: float | None
    flash_attn_us: float | None
    notes: str
    vs_first: float | None = None  # the shape's first KV dtype's time over this row's


def _time_baseline(
    timer: Timer,
    make: Callable[[], Callable[[], torch.Tensor]],
    expected: torch.Tensor,
    required: bool = False,
) -> tuple[float | None, str]:
    """Seconds, or None and why; a baseline that disagrees with the kernel is flagged. A
    ``required`` one (torch's own, always installed) that cannot run raises: its column must
    not go silently empty."""
    try:
        fn = make()
        diff = (fn().float() - expected.float()).abs().max().item()
        seconds = timer(fn)
    except ImportError:
        if required:
            raise
        return None, ""
    except Exception as exc:  # a peer's baseline that cannot run this shape is reported
        if required:
            raise RuntimeError(f"the SDPA baseline failed on {expected.shape}: {exc}") from exc
        return None, f"{exc.__class__.__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
    tol = 2e-2 if expected.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return seconds, "" if diff <= tol else f"differs from the kernel by {diff:.2g}"


def bench_shape(
    case: Case, timer: Timer, roofs: tuple[float, float], num_splits: int | None, sweep: bool
) -> Row:
    copy_bps, read_bps = roofs
    kernel = _kernel_under_test(case, num_splits)
    expected = kernel()
    seconds = timer(kernel)
    nbytes = case.kv_bytes()
    splits = None
    if case.q.is_cuda:
        from kernels import triton_attention

        window = case.shape.window
        args = (case.q, case.k_cache, case.v_cache, case.tables, window, num_splits)
        splits = triton_attention.launch_plan(*args).num_splits
    best_us, best = (None, "")
    if sweep and case.q.is_cuda:
        best_us, best = sweep_tiles(case, timer, expected, splits)
    notes = []
    baselines = {}
    for name, make in (("sdpa", _sdpa), ("flashinfer", _flashinfer), ("flash_attn", _flash_attn)):
        required = name == "sdpa"
        baselines[name], note = _time_baseline(
            timer, lambda make=make: make(case), expected, required
        )
        if note:
            notes.append(f"{name}: {note}")
    return Row(
        shape=case.shape.name,
        kv=next(n for n, d in kv_quant.KV_DTYPES.items() if d == case.k_cache.dtype),
        kv_mib=nbytes / 2**20,
        num_splits=splits,
        us=seconds * 1e6,
        gbs=nbytes / seconds / 1e9,
        copy_frac=nbytes / seconds / copy_bps,
        read_frac=nbytes / seconds / read_bps,
        best_us=best_us,
        best=best,
        sdpa_us=_us(baselines["sdpa"]),
        flashinfer_us=_us(baselines["flashinfer"]),
        flash_attn_us=_us(baselines["flash_attn"]),
        notes="; ".join(notes),
    )


def tile_candidates(shape: Shape, dtype: torch.dtype, block_size: int = 16) -> list:
    from kernels.triton_attention import Tile, decode_tile

    group = shape.num_heads // shape.num_kv_heads
    default = decode_tile(dtype, shape.dk, group, block_size, shape.window)
    rows = sorted({default.rows} | {r for r in (16, 32, 64) if r < group})
    block_ns = (16, 32) if shape.dk > 256 else (32, 64)
    tiles = [Tile(r, n, w, st) for r in rows for n in block_ns for w in (4, 8) for st in (2, 3)]
    return [default] + [t for t in tiles if t != default]


def sweep_tiles(
    case: Case, timer: Timer, expected: torch.Tensor, splits: int
) -> tuple[float | None, str]:
    """The fastest (tile, split count) among the candidates that agree with the default."""
    tol = 2e-2 if expected.dtype in (torch.bfloat16, torch.float16) else 1e-4
    results = []
    for tile in tile_candidates(case.shape, case.k_cache.dtype, case.k_cache.shape[1]):
        fn = _kernel_under_test(case, splits, tile)
        try:
            ok = (fn().float() - expected.float()).abs().max().item() <= tol
        except Exception:  # a tile the target cannot compile (shared memory) is skipped
            continue
        if ok:
            results.append((timer(fn), tile, splits))
    if not results:
        return None, ""
    _, tile, _ = min(results, key=lambda r: r[0])
    for n in {max(1, splits // 2), splits * 2} - {splits}:
        results.append((timer(_kernel_under_test(case, n, tile)), tile, n))
    seconds, tile, n = min(results, key=lambda r: r[0])
    return (
        seconds * 1e6,
        f"rows {tile.rows} n {tile.block_n} w{tile.num_warps} s{tile.num_stages} splits {n}",
    )


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def markdown(rows: list[Row], kernel: str, roofs: tuple[float, float]) -> str:
    head = (
        f"| shape | KV dtype | K/V MiB | splits | {kernel} µs | vs first | GB/s | of copy BW "
        "| of read BW | best µs (--sweep) | best tile | SDPA µs (dense) | FlashInfer µs "
        "| flash-attn µs |"
    )
    lines = [head, "|" + "---|" * 14]
    cell = lambda x, f="{:.1f}": "–" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.kv} | {r.kv_mib:.3g} | {cell(r.num_splits, '{}')} | {r.us:.1f} "
            f"| {cell(r.vs_first, '{:.2f}x')} | {r.gbs:.1f} | {r.copy_frac:.0%} "
            f"| {r.read_frac:.0%} | {cell(r.best_us)} "
            f"| {r.best or '–'} | {cell(r.sdpa_us)} | {cell(r.flashinfer_us)} "
            f"| {cell(r.flash_attn_us)} |"
        )
    notes = [f"- {r.shape} {r.kv}: {r.notes}" for r in rows if r.notes]
    footer = [
        f"\nDevice copy bandwidth (read + write): {roofs[0] / 1e9:.0f} GB/s; "
        f"read-only (a sum): {roofs[1] / 1e9:.0f} GB/s."
    ]
    return "\n".join(lines + footer + (["", "Baselines not run:", *notes] if notes else []))


def environment(device: str) -> dict:
    env = {"device": platform.processor() or platform.machine(), "torch": torch.__version__}
    if device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(device)
        import triton

        env["triton"] = triton.__version__
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel_speed", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch path)")
    parser.add_argument("--out", type=Path, help="write PREFIX.md and PREFIX.json")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--kv", nargs="+", choices=list(kv_quant.KV_DTYPES), help="KV dtypes (default --dtype)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num-splits", type=int, help="force split-K (default: the heuristic)")
    parser.add_argument("--only", nargs="+", help="run shapes whose name contains one of these")
    parser.add_argument("--no-flush", action="store_true", help="keep L2 warm between repeats")
    parser.add_argument("--sweep", action="store_true", help="also try other tiles and splits")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke for a CPU run of the torch path", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    repeats, warmup = (3, 1) if args.smoke else (args.repeats, args.warmup)
    timer = Timer(device, repeats, warmup, flush=not args.no_flush)
    nbytes = (16 << 20) if args.smoke else (1 << 30)
    roofs = (copy_bandwidth(timer, device, nbytes), read_bandwidth(timer, device, nbytes))
    shapes = smoke_shapes() if args.smoke else full_shapes()
    shapes = [s for s in shapes if not args.only or any(o in s.name for o in args.only)]
    rows = []
    for shape in shapes:
        for kv in args.kv or [args.dtype]:
            if kv in QUANTIZED_KV and (shape.dk % 32 or shape.dv % 32):
                print(f"{shape.name}: no {kv} rows of {shape.dk}/{shape.dv}", file=sys.stderr)
                continue
            case = build_case(shape, args.block_size, dtype, device, kv)
            row = bench_shape(case, timer, roofs, args.num_splits, args.sweep)
            row.vs_first = next(r.us for r in rows + [row] if r.shape == row.shape) / row.us
            rows.append(row)
            print(f"{shape.name} {kv}: {rows[-1].us:.1f} us", file=sys.stderr)
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
    kernel = "triton" if device == "cuda" else "torch"
    table = markdown(rows, kernel, roofs)
    print(table)
    if args.out:
        _write(args, rows, table, kernel, roofs, device)
    return 0


def _write(args, rows: list[Row], table: str, kernel: str, roofs: tuple, device: str) -> None:
    env = environment(device)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m bench.kernel_speed " + " ".join(sys.argv[1:])
    meta = {**env, "date": date, "command": command, "kernel": kernel}
    meta |= {"block_size": args.block_size, "dtype": args.dtype, "copy_gbs": roofs[0] / 1e9}
    meta["read_gbs"] = roofs[1] / 1e9
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {**meta, "rows": [asdict(r) for r in rows]}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    args.out.with_suffix(".md").write_text(f"# Paged decode attention\n\n{header}\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
