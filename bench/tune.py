"""`kvserve tune`: run one workload against a grid of engine settings and name the best point.

Each point of the sweep (the cartesian product of the ``--sweep`` values, over the base engine
flags) gets a fresh engine and HTTP server in this process on a loopback port; the workload is
`kvserve bench`'s load generator, and both are stopped before the next point starts::

    kvserve tune --model smollm2-135m-instruct --sweep max_num_seqs=4,16 \\
        --sweep preemption_mode=recompute,swap --num-prompts 50 --slo ttft=500,tpot=50

Writes tune.md (the table), tune.csv, tune.json (every measurement) and tune.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import difflib
import gc
import itertools
import json
import logging
import math
import socket
import sys
import textwrap
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from bench import quality
from bench.cli import add_workload_arguments, workload_from_args
from bench.loadtest import (
    BenchConfig,
    BenchError,
    BenchResult,
    _json_safe,
    counter_sum,
    load_dataset,
    parse_metrics,
    run_benchmark,
    spec_acceptance,
)
from engine.args import EngineArgs, add_cli_args, from_cli_args
from engine.core.context_overflow import IMPORTANCE_POLICIES
from models.fetch import resolve_model
from models.tokenizer import Tokenizer

DEFAULT_MAX_POINTS = 16
# Points within this fraction of the best value tie: a smaller lead is under the run-to-run
# noise of even a quiet machine, no reason to prefer a point.
TIE_TOLERANCE = 0.02
MAX_PLOT_WIDTH = 16.0  # inches


@dataclass(frozen=True)
class Objective:
    name: str
    metric: str  # a PointMetrics field
    maximize: bool
    label: str
    unit: str


OBJECTIVES = {
    o.name: o
    for o in (
        Objective("goodput", "goodput", True, "goodput", "req/s"),
        Objective("throughput", "output_throughput", True, "output", "tok/s"),
        Objective("p99_ttft", "p99_ttft_ms", False, "p99 TTFT", "ms"),
        Objective("p99_itl", "p99_itl_ms", False, "p99 ITL", "ms"),
    )
}
# How best_point breaks ties, by whether the objective is maximized.
SECONDARY = {True: "lower p99 TTFT", False: "higher output tok/s"}


# --- the sweep ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    name: str  # an EngineArgs field
    values: tuple[Any, ...]


def engine_fields() -> dict[str, Any]:
    """EngineArgs field name -> type hint, read at run time so new engine options sweep too."""
    hints = typing.get_type_hints(EngineArgs)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineArgs) if f.init}


def parse_sweep(text: str, fields: Mapping[str, Any]) -> Sweep:
    """``NAME=V1,V2,...`` -> Sweep; NAME is an EngineArgs field, ``-`` and ``_`` alike."""
    raw_name, sep, raw_values = text.partition("=")
    name = raw_name.strip().replace("-", "_")
    if not sep or not name:
        raise ValueError(f"--sweep {text!r}: expected NAME=V1,V2,...")
    if name not in fields:
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"--sweep: unknown engine setting {raw_name.strip()!r}{hint}; "
            f"valid: {', '.join(fields)}"
        )
    words = [w.strip() for w in raw_values.split(",")]
    if not any(words) or not all(words):
        raise ValueError(f"--sweep {text!r}: empty value")
    values = tuple(parse_value(w, fields[name], name) for w in words)
    if len(set(values)) != len(values):
        raise ValueError(f"--sweep {name}: a value is given twice")
    return Sweep(name, values)


def parse_value(word: str, hint: Any, name: str = "value") -> Any:
    """A flag's text as the field's type: bool, int, float, str, or None for ``none``."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if type(None) in options and word.lower() in ("none", "null"):
        return None
    # bool before int (True is an int) and int before float, so "4" is 4 for int | float.
    for kind in sorted((o for o in options if o is not type(None)), key=_parse_order):
        if kind is bool and word.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return word.lower() in ("true", "yes", "on", "1")
        if kind in (int, float):
            with contextlib.suppress(ValueError):
                return kind(word)
        if kind is str:
            return word
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ValueError(f"--sweep {name}: {word!r} is not a {names}")


def _parse_order(kind: Any) -> int:
    order = (bool, int, float, str)
    return order.index(kind) if kind in order else len(order)


def sweep_points(base: EngineArgs, sweeps: Sequence[Sweep]) -> list[tuple[dict, EngineArgs]]:
    """Every combination, first sweep slowest, as (settings, EngineArgs); checked up front so
    a bad value fails before any model is loaded."""
    names = [s.name for s in sweeps]
    if len(set(names)) != len(names):
        raise ValueError("--sweep: a setting is swept twice; give all its values in one --sweep")
    points = []
    for combo in itertools.product(*(s.values for s in sweeps)):
        settings = dict(zip(names, combo))
        try:
            args = dataclasses.replace(base, **settings)
        except (ValueError, TypeError) as e:
            raise ValueError(f"point {format_settings(settings)}: {e}") from e
        if "kv_cache_memory_gib" in settings and args.num_kv_blocks is not None:
            raise ValueError(
                "num_kv_blocks overrides kv_cache_memory_gib, so its sweep would change nothing; "
                "drop --num-kv-blocks"
            )
        points.append((settings, args))
    return points


def format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def format_settings(settings: Mapping[str, Any], sep: str = " ") -> str:
    return sep.join(f"{k}={format_value(v)}" for k, v in settings.items())


# --- one point ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointMetrics:
    """What the table compares; counters are the growth of the engine's Prometheus counters."""

    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    goodput: float | None
    p99_ttft_ms: float | None
    p99_itl_ms: float | None
    mean_tpot_ms: float | None
    prefix_hit_pct: float | None  # prompt tokens served by the prefix cache, % of those asked
    spec_accept_pct: float | None  # drafted tokens accepted, % (None: no speculation)
    preemptions: float
    context_overflows: float
    rejected: int  # 429: refused by admission control
    errors: int  # every other failed request (400s included: a policy that refuses)

    @classmethod
    def from_result(cls, result: BenchResult, counters: Mapping[str, float]) -> PointMetrics:
        s = result.summary
        rejected = s.failed_by_status.get("429", 0)
        queries = counter_sum(counters, "prefix_cache_queries_total")
        hits = counter_sum(counters, "prefix_cache_hits_total")
        return cls(
            completed=s.completed,
            failed=s.failed,
            request_throughput=s.request_throughput,
            output_throughput=s.output_throughput,
            goodput=s.goodput,
            p99_ttft_ms=s.ttft.p99_ms,
            p99_itl_ms=s.itl.p99_ms,
            mean_tpot_ms=s.tpot.mean_ms,
            prefix_hit_pct=100 * hits / queries if queries else None,
            spec_accept_pct=spec_acceptance(counters),
            preemptions=counter_sum(counters, "num_preemptions_total"),
            context_overflows=counter_sum(counters, "context_overflows_total"),
            rejected=rejected,
            errors=s.failed - rejected,
        )


@dataclass
class PointResult:
    index: int  # 1-based, in sweep order
    settings: dict[str, Any]
    engine_args: EngineArgs
    metrics: PointMetrics | None = None
    error: str | None = None  # the point could not run (engine or server start)
    bench: BenchResult | None = None
    counters: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def value(self, metric: str) -> float | None:
        return None if self.metrics is None else getattr(self.metrics, metric)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "index": self.index,
                "settings": self.settings,
                "engine_args": dataclasses.asdict(self.engine_args),
                "metrics": dataclasses.asdict(self.metrics) if self.metrics else None,
                "error": self.error,
                "counter_deltas": self.counters,
                "wall_s": self.wall_s,
                "bench": self.bench.to_dict() if self.bench else None,
            }
        )


class EngineHandle:
    """Forwards to an engine until released.

    FastAPI keeps module-level caches of endpoint callables (strong references, thousands of
    entries), so an app and everything its endpoints reach outlive its server. The app gets
    this handle instead of the engine, so that releasing it frees the model and KV cache for
    the next point.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if self._engine is None:
            raise RuntimeError("the engine of this tuning point was released")
        return getattr(self._engine, name)

    def release(self) -> None:
        self._engine = None


@contextlib.contextmanager
def serve_engine(args: EngineArgs) -> Iterator[tuple[Any, str, str]]:
    """A fresh engine behind the HTTP app on uvicorn, on a free loopback port, in a thread:
    yields (engine, base URL, served model name)."""
    import uvicorn

    from engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.args import ServerArgs

    engine = AsyncEngine(args)
    handle = EngineHandle(engine)
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        name = engine.model_name
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(handle, ServerArgs(served_model_name=name)), log_level="warning"
            )
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        try:
            yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}", name
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    finally:
        sock.close()
        engine.shutdown()
        handle.release()


def engine_counters(engine: Any) -> dict[str, float] | None:
    """The engine's Prometheus counters read in-process; None when it keeps none."""
    registry = getattr(getattr(engine.engine, "metrics", None), "registry", None)
    if registry is None:
        return None
    from prometheus_client import generate_latest

    return parse_metrics(generate_latest(registry).decode())[1]


def warm_up(url: str, model: str, n: int) -> None:
    """Short requests before the measurement, so the first point does not pay one-time costs
    (kernel selection, allocator growth) that the later ones skip."""
    with httpx.Client(trust_env=False, timeout=120) as client:
        for _ in range(n):
            body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{url}/v1/completions", json=body)


def run_point(point: PointResult, workload: BenchConfig, warmup: int) -> PointResult:
    t0 = time.perf_counter()
    try:
        point.bench, point.counters = measure(point.engine_args, workload, warmup)
    except (BenchError, KeyboardInterrupt):
        raise
    except Exception as e:  # a point that cannot start is a result; the sweep goes on
        point.error = f"{type(e).__name__}: {e}"
    else:
        point.metrics = PointMetrics.from_result(point.bench, point.counters)
    finally:
        point.wall_s = time.perf_counter() - t0
        _release_memory()
    return point


def measure(
    args: EngineArgs, workload: BenchConfig, warmup: int
) -> tuple[BenchResult, dict[str, float]]:
    """One point's benchmark and counter growth; the engine is gone when this returns (its
    own frame holds the last reference, so the next point starts with the memory free)."""
    with serve_engine(args) as (engine, url, name):
        warm_up(url, name, warmup)
        before = engine_counters(engine)
        config = dataclasses.replace(workload, base_url=f"{url}/v1", model=name)
        result = asyncio.run(run_benchmark(config))
        after = engine_counters(engine)
    if before is None or after is None:
        return result, result.metrics.counter_deltas
    return result, {k: v - before.get(k, 0.0) for k, v in after.items()}


def _release_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_sweep(
    points: Sequence[PointResult],
    workload: BenchConfig,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[PointResult]:
    """Run every point in order; Ctrl-C stops the sweep and keeps the points already done."""
    done = []
    for point in points:
        head = f"[{point.index}/{len(points)}] {format_settings(point.settings)}"
        if progress:
            progress(f"{head} ...")
        try:
            done.append(run_point(point, workload, warmup))
        except KeyboardInterrupt:
            if progress:
                progress(f"interrupted: reporting {len(done)} of {len(points)} points")
            break
        if progress:
            progress(f"{head}: {point_line(point)}")
    return done


def point_line(p: PointResult) -> str:
    if p.metrics is None:
        return f"failed ({p.error}) in {p.wall_s:.1f} s"
    m = p.metrics
    s = p.bench.summary if p.bench else None
    planned = s.completed + s.failed + s.cancelled + s.not_sent if s else m.completed
    parts = [
        f"{m.completed}/{planned} ok",
        f"{m.request_throughput:.2f} req/s",
        f"{m.output_throughput:.1f} tok/s",
    ]
    if m.goodput is not None:
        parts.append(f"goodput {m.goodput:.2f} req/s")
    parts.append(f"p99 TTFT {_fmt(m.p99_ttft_ms, '.0f')} ms")
    for count, label in (
        (m.preemptions, "preempted"),
        (m.context_overflows, "context overflows"),
        (m.rejected, "rejected"),
        (m.errors, "errors"),
    ):
        if count:
            parts.append(f"{count:g} {label}")
    return ", ".join(parts) + f" in {p.wall_s:.1f} s"


# --- choosing -------------------------------------------------------------------------------


def best_point(points: Sequence[PointResult], objective: str) -> PointResult | None:
    """The best point for ``objective``, or None when no point measured it.

    Latency objectives compare only the points that completed the most requests: a setting
    must not win on p99 by refusing the requests that would have been slow. Points within
    TIE_TOLERANCE of the best value tie; a tie goes to fewer failures, then the better
    secondary (lower p99 TTFT for throughput objectives, higher throughput for latency ones),
    then sweep order.
    """
    obj = OBJECTIVES[objective]

    def secondary(p: PointResult) -> float:
        if obj.maximize:
            ttft = p.value("p99_ttft_ms")
            return math.inf if ttft is None else ttft
        return -p.metrics.output_throughput

    tied = tied_points(points, objective)
    return min(tied, key=lambda p: (p.metrics.failed, secondary(p), p.index), default=None)


def tied_points(points: Sequence[PointResult], objective: str) -> list[PointResult]:
    """The points eligible for ``objective`` whose value is within TIE_TOLERANCE of the best."""
    obj = OBJECTIVES[objective]
    ran = [p for p in points if p.metrics and p.metrics.completed and _has(p, obj.metric)]
    if not ran:
        return []
    if not obj.maximize:
        most = max(p.metrics.completed for p in ran)
        ran = [p for p in ran if p.metrics.completed == most]
    values = [p.value(obj.metric) for p in ran]
    if obj.maximize:
        edge = max(values) * (1 - TIE_TOLERANCE)
        return [p for p, v in zip(ran, values) if v >= edge]
    edge = min(values) * (1 + TIE_TOLERANCE)
    return [p for p, v in zip(ran, values) if v <= edge]


def _has(p: PointResult, metric: str) -> bool:
    v = p.value(metric)
    return v is not None and math.isfinite(v)


# --- report ---------------------------------------------------------------------------------

# (PointMetrics field, table header, number format)
COLUMNS = (
    ("request_throughput", "req/s", ".2f"),
    ("output_throughput", "out tok/s", ".1f"),
    ("goodput", "goodput req/s", ".2f"),
    ("p99_ttft_ms", "p99 TTFT ms", ".0f"),
    ("p99_itl_ms", "p99 ITL ms", ".1f"),
    ("mean_tpot_ms", "mean TPOT ms", ".1f"),
    ("prefix_hit_pct", "prefix hit %", ".1f"),
    ("spec_accept_pct", "drafts accepted %", ".1f"),
    ("preemptions", "preempt", "g"),
    ("context_overflows", "ctx overflow", "g"),
    ("rejected", "429", "d"),
    ("errors", "errors", "d"),
)


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _columns(with_goodput: bool) -> list[tuple[str, str, str]]:
    return [c for c in COLUMNS if with_goodput or c[0] != "goodput"]


def markdown_table(
    points: Sequence[PointResult], names: Sequence[str], best: PointResult | None
) -> str:
    """One row per point; the best is starred. Cells are padded so the text reads as a table
    in a terminal, too."""
    cols = _columns(any(p.value("goodput") is not None for p in points))
    header = ["#", *names, *(c[1] for c in cols)]
    rows = []
    for p in points:
        mark = f"{p.index} ★" if p is best else str(p.index)
        cells = [format_value(p.settings[n]) for n in names]
        if p.metrics is None:
            metrics = ["failed"] + ["-"] * (len(cols) - 1)
        else:
            metrics = [_fmt(p.value(key), spec) for key, _, spec in cols]
        rows.append([mark, *cells, *metrics])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = len(names) + 1

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if i >= numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w + 2) if i < numeric else "-" * (w + 1) + ":" for i, w in enumerate(widths)]
    return "\n".join([line(header), "|" + "|".join(rule) + "|", *map(line, rows)])


def summary_lines(
    points: Sequence[PointResult],
    objective: str,
    best: PointResult | None,
    names: Sequence[str] | None = None,
) -> list[str]:
    """The verdict under the table; ``names`` are the settings worth repeating (default all)."""
    obj = OBJECTIVES[objective]
    lines = []
    if best is None:
        lines.append(
            f"No best point for {objective}: no point completed requests "
            f"with a measured {obj.label} {obj.unit}."
        )
    else:
        settings = {n: best.settings[n] for n in names or best.settings}
        value = _fmt(best.value(obj.metric), ".3g")
        extreme = "highest" if obj.maximize else "lowest"
        line = (
            f"Best for {objective}: #{best.index} {format_settings(settings)} "
            f"({obj.label} {value} {obj.unit}, the {extreme})"
        )
        others = [f"#{p.index}" for p in tied_points(points, objective) if p is not best]
        if others:
            line += (
                f"; {', '.join(others)} within {TIE_TOLERANCE:.0%}, "
                f"ties broken by fewer failures, then {SECONDARY[obj.maximize]}"
            )
        lines.append(line)
    for p in points:
        if p.error:
            lines.append(f"#{p.index} did not run: {p.error}")
        elif p.metrics and not p.metrics.completed and p.bench:
            failed = next((r for r in p.bench.requests if r.error), None)
            why = f": {failed.failure} {failed.error}" if failed else ""
            lines.append(f"#{p.index} completed no request{why}")
    return lines


def workload_text(w: BenchConfig) -> str:
    if w.dataset is not None:
        prompts = f"from {Path(w.dataset).name}"
    else:
        prompts = f"of {w.input_len} in / {w.output_len} out tokens"
    if math.isinf(w.request_rate):
        pace = "all at once"
    else:
        pace = f"at {w.request_rate:g} req/s"
    if w.max_concurrency:
        pace += f", at most {w.max_concurrency} in flight"
    text = f"{w.num_prompts} requests per point {prompts}, {pace}"
    if w.slo.defined:
        terms = [
            f"{name} <= {ms:g} ms"
            for name, ms in (
                ("TTFT", w.slo.ttft_ms),
                ("TPOT", w.slo.tpot_ms),
                ("E2E", w.slo.e2e_ms),
            )
            if ms is not None
        ]
        text += f"; SLO {', '.join(terms)}"
    return text


CSV_METRICS = [f.name for f in dataclasses.fields(PointMetrics)]


def write_csv(
    path: Path, points: Sequence[PointResult], names: Sequence[str], best: PointResult | None
) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", *names, *CSV_METRICS, "wall_s", "best", "error"])
        for p in points:
            metrics = [_csv_cell(p.value(m)) for m in CSV_METRICS]
            settings = [format_value(p.settings[n]) for n in names]
            row = [p.index, *settings, *metrics, f"{p.wall_s:.2f}", int(p is best), p.error or ""]
            w.writerow(row)
    return path


def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return value


@dataclass
class TuneReport:
    objective: str
    sweeps: list[Sweep]
    base: EngineArgs
    workload: BenchConfig
    points: list[PointResult]
    planned: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sweeps]

    @property
    def varying(self) -> list[str]:
        """The swept settings with more than one value: the table's columns."""
        names = [s.name for s in self.sweeps if len(s.values) > 1]
        return names or self.names

    @property
    def fixed(self) -> dict[str, Any]:
        """Settings given as a one-value sweep: the same at every point."""
        return {s.name: s.values[0] for s in self.sweeps if s.name not in self.varying}

    @property
    def description(self) -> str:
        """The workload, the fixed settings and how much of the sweep ran, in a line."""
        text = workload_text(self.workload)
        if self.fixed:
            text += f"; every point with {format_settings(self.fixed)}"
        if len(self.points) < self.planned:
            text += f"; {len(self.points)} of {self.planned} points ran"
        return text

    @property
    def best(self) -> PointResult | None:
        return best_point(self.points, self.objective)

    def markdown(self) -> str:
        best = self.best
        head = f"kvserve tune: {Path(self.base.model).name}, {self.description}"
        table = markdown_table(self.points, self.varying, best)
        return "\n\n".join(
            [head, table, "\n".join(summary_lines(self.points, self.objective, best, self.varying))]
        )

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return _json_safe(
            {
                "objective": self.objective,
                "best": best.index if best else None,
                "sweep": {s.name: list(s.values) for s in self.sweeps},
                "base_engine_args": dataclasses.asdict(self.base),
                "workload": {**dataclasses.asdict(self.workload), "api_key": None},
                "planned_points": self.planned,
                "points": [p.to_dict() for p in self.points],
            }
        )

    def write(self, out_dir: str | Path) -> list[Path]:
        """tune.md, tune.csv, tune.json and tune.png in ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md = out / "tune.md"
        md.write_text(self.markdown() + "\n")
        data = out / "tune.json"
        data.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        csv_path = write_csv(out / "tune.csv", self.points, self.names, self.best)
        png = out / "tune.png"
        fig = tune_figure(self)
        # The Agg canvas is attached per figure, so no global backend switch (pyplot) is needed.
        FigureCanvasAgg(fig)
        fig.savefig(png, dpi=100)
        return [md, csv_path, data, png]


def tune_figure(report: TuneReport) -> Figure:
    """Bars of goodput (or output tok/s) per point, the best one highlighted, with the p99
    latency the objective cares about as dots on a second axis."""
    points, best = report.points, report.best
    bars = OBJECTIVES["goodput" if report.objective == "goodput" else "throughput"]
    dots = OBJECTIVES["p99_itl" if report.objective == "p99_itl" else "p99_ttft"]
    labels, xlabel, width = _tick_labels(report)
    fig = Figure(figsize=(width, 4.8), layout="constrained")
    x = np.arange(len(points))
    ax = fig.subplots()
    heights = [p.value(bars.metric) or 0.0 for p in points]
    colors = ["tab:orange" if p is best else "tab:blue" for p in points]
    bar_values = ax.bar(x, heights, color=colors, width=0.6)
    texts = ["" if p.metrics is None else format(h, ".3g") for p, h in zip(points, heights)]
    ax.bar_label(bar_values, labels=texts, fontsize=8)
    for xi, p in zip(x, points):
        if p.metrics is None:
            ax.text(xi, 0, "failed", ha="center", va="bottom", rotation=90, color="tab:red")
    ax.set_ylabel(f"{bars.label} ({bars.unit})")
    ax.set_ylim(0, max(heights, default=0.0) * 1.1 or 1.0)
    ax.grid(axis="y", alpha=0.3)
    twin = ax.twinx()
    latencies = [_nan(p.value(dots.metric)) for p in points]
    twin.plot(x, latencies, "o", color="black", label=f"{dots.label} ({dots.unit})")
    twin.set_ylabel(f"{dots.label} ({dots.unit})")
    twin.set_ylim(0, max([v for v in latencies if math.isfinite(v)], default=1.0) * 1.1)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    handles = [Patch(color="tab:blue", label="point")]
    if best is not None:
        handles.append(Patch(color="tab:orange", label=f"best for {report.objective}"))
    handles.append(twin.get_lines()[0])
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(f"kvserve tune: {Path(report.base.model).name}", fontsize=10)
    chars = int(fig.get_figwidth() * 14)  # of the 8 pt subtitle
    ax.set_title(textwrap.fill(report.description, chars), fontsize=8)
    return fig


def _tick_labels(report: TuneReport) -> tuple[list[str], str, float]:
    """Tick labels, the x-axis label and the figure width in inches.

    Each tick reads ``name=value`` per line while the figure stays under MAX_PLOT_WIDTH;
    past that only the values, with the names once on the axis.
    """
    names, points = report.varying, report.points

    def fit(labels: list[str]) -> float:
        longest = max(len(line) for label in labels for line in label.split("\n"))
        return max(6.0, len(points) * max(0.8, 0.07 * longest) + 2.5)  # 0.07 in: 8 pt char

    full = [
        "\n".join([f"#{p.index}", *(f"{n}={format_value(p.settings[n])}" for n in names)])
        for p in points
    ]
    if fit(full) <= MAX_PLOT_WIDTH:
        return full, "", fit(full)
    short = [
        "\n".join([f"#{p.index}", *(format_value(p.settings[n]) for n in names)]) for p in points
    ]
    return short, " / ".join(names), min(fit(short), MAX_PLOT_WIDTH)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


# --- CLI ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve tune",
        description="Run one workload against every combination of engine settings and name "
        "the best; each point gets a fresh engine and server on a loopback port.",
        epilog="example: kvserve tune --model smollm2-135m-instruct --sweep max_num_seqs=4,16 "
        "--sweep preemption_mode=recompute,swap --num-prompts 50 --slo ttft=500,tpot=50",
    )
    add_cli_args(p)
    t = p.add_argument_group("sweep")
    t.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="an engine setting and its values; repeat for a grid (see --list-settings); "
        "one value fixes a setting",
    )
    t.add_argument(
        "--objective",
        choices=sorted([*OBJECTIVES, "quality"]),
        help="what the best point maximizes or minimizes (default: goodput with --slo, else "
        "throughput, in output tokens/s); quality: the perplexity of --text under each context "
        "policy, and each next-token distribution's KL divergence and top-1 agreement against "
        "the float32-KV full-context run (--sweep kv_cache_dtype=float32,int8,int4: the grid "
        "under each KV dtype; another --sweep: each point's own policy beside its throughput)",
    )
    t.add_argument(
        "--max-points",
        type=int,
        default=DEFAULT_MAX_POINTS,
        metavar="N",
        help="refuse larger grids (default %(default)s)",
    )
    t.add_argument(
        "--warmup", type=int, default=1, metavar="N", help="unmeasured requests per point"
    )
    t.add_argument(
        "--list-settings", action="store_true", help="list the sweepable settings and exit"
    )
    add_workload_arguments(p, seed=False)
    add_quality_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        default="tune-results",
        metavar="DIR",
        help="where tune.md, tune.csv, tune.json and tune.png go, or quality.md, quality.json "
        "and quality.png (default %(default)s)",
    )
    out.add_argument("--verbose", action="store_true", help="engine and server logs")
    return p


def add_quality_arguments(p: argparse.ArgumentParser) -> None:
    q = p.add_argument_group("quality (--objective quality)")
    q.add_argument(
        "--text",
        metavar="FILE",
        help=f"the text to score: a file, or {', '.join(quality.TEXTS)} (public domain, "
        "fetched once from PyPI)",
    )
    q.add_argument(
        "--text-tokens",
        type=int,
        metavar="N",
        help="score the first N tokens of the text (default: 4 x --max-model-len); the "
        "float32-KV reference keeps a float32 row of the vocabulary per token in host memory "
        "(0.6 GB per 1000 tokens of a 152k vocabulary)",
    )
    q.add_argument(
        "--n-keep",
        type=_int_list,
        default=(0, 4),
        metavar="K1,K2",
        help="n_keep values of the policy grid (default 0,4; sink with 0 is the plain window)",
    )
    q.add_argument(
        "--n-discard",
        type=_int_list,
        default=(None,),
        metavar="D1,D2",
        help="n_discard values for shift (default: the policy's own, half the context)",
    )
    q.add_argument(
        "--kv-budgets",
        type=_int_list,
        default=(0,),
        metavar="B1,B2",
        help="KV budgets (cached tokens per sequence) of the importance policies snapkv, h2o "
        "and knorm in the grid (default 0: none, they evict when the context fills)",
    )
    q.add_argument(
        "--chunk",
        type=int,
        default=quality.DEFAULT_CHUNK,
        metavar="N",
        help="tokens per resent request under truncate (default %(default)s)",
    )


def _int_list(text: str) -> tuple[int | None, ...]:
    """``0,4`` -> (0, 4); ``none`` stands for the policy's default."""
    return tuple(parse_value(w.strip(), int | None, "list") for w in text.split(","))


def list_settings() -> str:
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    lines = []
    for name, hint in engine_fields().items():
        default = defaults[name]
        shown = "required" if default is dataclasses.MISSING else f"default {format_value(default)}"
        lines.append(f"  {name:<26}{_type_name(hint):<16}{shown}")
    return "sweepable engine settings (--sweep NAME=V1,V2):\n" + "\n".join(lines)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(
            getattr(a, "__name__", str(a)).replace("NoneType", "none")
            for a in typing.get_args(hint)
        )
    return getattr(hint, "__name__", str(hint))


@dataclass
class TunePlan:
    sweeps: list[Sweep]
    base: EngineArgs
    workload: BenchConfig
    objective: str
    points: list[PointResult]


def plan_from_args(args: argparse.Namespace) -> TunePlan:
    """Everything checked before the first engine starts; raises ValueError or BenchError."""
    if not args.sweep:
        raise ValueError("give at least one --sweep NAME=V1,V2 (see --list-settings)")
    fields = engine_fields()
    sweeps = [parse_sweep(text, fields) for text in args.sweep]
    size = math.prod(len(s.values) for s in sweeps)
    if size > args.max_points:
        raise ValueError(
            f"the sweep has {size} points, over --max-points {args.max_points}; "
            "sweep fewer values or raise --max-points"
        )
    base = from_cli_args(args)
    points = [
        PointResult(i, settings, engine_args)
        for i, (settings, engine_args) in enumerate(sweep_points(base, sweeps), 1)
    ]
    workload = BenchConfig(**workload_from_args(args), show_progress=False)
    if workload.dataset is not None:
        load_dataset(workload)
    objective = args.objective or ("goodput" if workload.slo.defined else "throughput")
    if objective == "quality":  # the throughput half of a quality sweep
        objective = "throughput"
    if objective == "goodput" and not workload.slo.defined:
        raise ValueError("--objective goodput needs --slo (e.g. --slo ttft=500,tpot=50)")
    if args.warmup < 0:
        raise ValueError("--warmup must not be negative")
    return TunePlan(sweeps, base, workload, objective, points)


def quiet_logs(verbose: bool) -> None:
    """The engine logs its layout at every start and httpx every request: per point, noise."""
    if not verbose:
        for name in ("kvserve", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str]) -> int:
    """``kvserve tune``: 0 when some point completed requests, 1 when none did, 2 on bad usage."""
    if "--list-settings" in argv:
        print(list_settings())
        return 0
    args = build_parser().parse_args(argv)
    if args.objective == "quality":
        return quality_main(args)
    try:
        plan = plan_from_args(args)
    except (ValueError, BenchError) as e:
        print(f"kvserve tune: {e}", file=sys.stderr)
        return 2
    quiet_logs(args.verbose)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    progress(f"tuning {len(plan.points)} points for {plan.objective}")
    try:
        done = run_sweep(plan.points, plan.workload, args.warmup, progress)
    except BenchError as e:
        print(f"kvserve tune: {e}", file=sys.stderr)
        return 2
    report = TuneReport(
        plan.objective, plan.sweeps, plan.base, plan.workload, done, len(plan.points)
    )
    print(report.markdown())
    for path in report.write(args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0 if any(p.metrics and p.metrics.completed for p in done) else 1


def quality_main(args: argparse.Namespace) -> int:
    """``--objective quality``: the policy grid scored over the text (under each KV cache dtype
    with ``--sweep kv_cache_dtype=...``), or with any other ``--sweep`` each point's own policy
    scored beside its throughput; KLD and top-1 agreement against the float32-KV full-context
    run of the text throughout."""
    if not args.text or not args.max_model_len:
        print("kvserve tune: --objective quality needs --text and --max-model-len", file=sys.stderr)
        return 2
    quiet_logs(args.verbose)
    base = from_cli_args(args)
    try:
        kv_dtypes = kv_dtype_sweep(base, [parse_sweep(t, engine_fields()) for t in args.sweep])
    except ValueError as e:
        print(f"kvserve tune: {e}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(resolve_model(base.model))
    tokens = tokenizer.encode(quality.load_text(args.text))
    tokens = tokens[: args.text_tokens or 4 * base.max_model_len]
    limit, description = (
        base.max_model_len,
        quality.describe(base.model, len(tokens), base.max_model_len, args.chunk, base.block_size),
    )
    if args.sweep and kv_dtypes is None:
        return quality_sweep(args, base, tokens, description)
    policies = [quality.Policy("full context", None)]
    policies += quality.policy_grid(args.n_keep, args.n_discard, args.kv_budgets)
    results = quality.score_kv_dtypes(
        base, tokens, kv_dtypes or [base.kv_cache_dtype], policies, limit, args.chunk, True
    )
    print(f"{description}\n\n{quality.markdown_table(results)}")
    for path in quality.write_report(results, description, limit, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def kv_dtype_sweep(base: EngineArgs, sweeps: Sequence[Sweep]) -> list[str] | None:
    """The KV cache dtypes of a sweep of kv_cache_dtype alone (checked); None for any other."""
    if len(sweeps) != 1 or sweeps[0].name != "kv_cache_dtype":
        return None
    return [args.kv_cache_dtype for _, args in sweep_points(base, sweeps)]


def quality_sweep(
    args: argparse.Namespace, base: EngineArgs, tokens: list[int], description: str
) -> int:
    """The throughput sweep, then each point's own policy (and KV dtype) scored over the text."""
    try:
        plan = plan_from_args(args)
    except (ValueError, BenchError) as e:
        print(f"kvserve tune: {e}", file=sys.stderr)
        return 2
    done = run_sweep(
        plan.points, plan.workload, args.warmup, lambda line: print(line, file=sys.stderr)
    )
    reference = quality.reference_run(base, tokens)
    full_context = quality.Policy("full context", None)
    limit = base.max_model_len
    full = quality.score(base, tokens, [full_context], limit, args.chunk, reference=reference)[0]
    rows = []
    for p in done:
        overflow = p.engine_args.default_overflow()
        result = None
        if overflow.policy in ("truncate", "shift", "sink", *IMPORTANCE_POLICIES):
            policy = quality.Policy(format_settings(p.settings), overflow)
            lim = p.engine_args.max_model_len
            (result,) = quality.score(
                p.engine_args, tokens, [policy], lim, args.chunk, True, reference
            )
        rows.append((p, result))
    table = combined_table(rows, full)
    print(f"{description}\n\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.md").write_text(f"{description}\n\n{table}\n")
    print(f"wrote {out / 'quality.md'}", file=sys.stderr)
    return 0


def combined_table(rows: Sequence[tuple[PointResult, Any]], full: Any) -> str:
    """Throughput and latency beside perplexity, KLD and top-1 agreement (against the
    float32-KV full context), one line per point of a quality sweep."""
    lines = [
        "| # | settings | output tok/s | p99 TTFT ms | perplexity | after overflow | mean KLD | "
        "top-1 % | mean KLD after overflow | top-1 % after overflow |",
        "|---|---|---|---|---|---|---|---|---|---|",
        "| - | full context | - | - | " + " | ".join(_quality_cells(full)) + " |",
    ]
    for p, r in rows:
        m = p.metrics
        lines.append(
            f"| {p.index} | {format_settings(p.settings)} | "
            f"{_fmt(m and m.output_throughput, '.1f')} | {_fmt(m and m.p99_ttft_ms, '.0f')} | "
            + " | ".join(_quality_cells(r))
            + " |"
        )
    return "\n".join(lines)


def _quality_cells(r: quality.QualityResult | None) -> list[str]:
    if r is None:
        return ["-"] * 6
    return [
        f"{r.ppl:.2f}",
        f"{r.ppl_after:.2f}",
        *quality.divergence_cells(r.divergence()),
        *quality.divergence_cells(r.divergence_after),
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
