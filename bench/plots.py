"""PNG plots of a `kvserve bench` result: latency distributions and the run over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.loadtest import BenchResult, RequestRecord


def save_plots(result: BenchResult, plot_dir: str | Path) -> list[Path]:
    """Write latency.png and timeline.png into ``plot_dir``; returns their paths."""
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _save(latency_figure(result), out / "latency.png"),
        _save(timeline_figure(result), out / "timeline.png"),
    ]


def _save(fig: Figure, path: Path) -> Path:
    # The Agg canvas is attached per figure, so no global backend switch (pyplot) is needed.
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def latency_figure(result: BenchResult) -> Figure:
    """Histograms (top row) and CDFs (bottom row) of TTFT, TPOT, ITL and E2E latency."""
    ok = [r for r in result.requests if r.success]
    samples = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [x for r in ok for x in r.itl_s],
        "E2E": [t for r in ok if (t := r.e2e_s) is not None],
    }
    fig = Figure(figsize=(16, 7), layout="constrained")
    axes = fig.subplots(2, len(samples))
    for col, (name, values) in enumerate(samples.items()):
        hist_ax, cdf_ax = axes[0][col], axes[1][col]
        ms = np.sort(np.asarray(values, dtype=np.float64) * 1e3)
        for ax in (hist_ax, cdf_ax):
            ax.set_xlabel(f"{name} (ms)")
            ax.grid(alpha=0.3)
        if len(ms) == 0:
            hist_ax.text(0.5, 0.5, "no samples", ha="center", transform=hist_ax.transAxes)
            continue
        hist_ax.hist(ms, bins=min(50, max(10, len(ms) // 5)), color="tab:blue")
        hist_ax.set_ylabel("count")
        cdf_ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), color="tab:blue")
        cdf_ax.set_ylabel("fraction ≤ x")
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(ms, q))
            hist_ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.1f}")
        hist_ax.legend(fontsize=8)
    fig.suptitle(f"{result.model}: latency over {result.summary.completed} successful requests")
    return fig


def timeline_figure(result: BenchResult) -> Figure:
    """Throughput, requests in flight / running / waiting and KV usage against time."""
    series = result.metrics
    has_kv = any(name.startswith("kv_cache_usage_perc") for name in series.values)
    fig = Figure(figsize=(12, 9 if has_kv else 6.5), layout="constrained")
    axes = fig.subplots(3 if has_kv else 2, 1, sharex=True)
    end = max(result.summary.duration_s, 1e-3)
    _plot_throughput(axes[0], result.requests, end)
    _plot_requests(axes[1], result)
    if has_kv:
        ax = axes[2]
        for name, values in series.values.items():
            if name.startswith("kv_cache_usage_perc"):
                label = "max over groups" if name == "kv_cache_usage_perc" else name[19:]
                ax.plot(series.t_s, _nan(values), label=label, drawstyle="steps-post")
        ax.set_ylabel("KV cache usage")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(f"{result.model}: {result.summary.completed} requests in {end:.1f} s")
    return fig


def _plot_throughput(ax: Axes, records: list[RequestRecord], end: float) -> None:
    # Bins of at least 0.25 s, about 60 of them, so short runs still show a shape.
    width = max(0.25, end / 60)
    edges = np.arange(0.0, end + width, width)
    times, weights = _token_events(records)
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    done = [r.end_s for r in records if r.success and r.end_s is not None]
    finished, _ = np.histogram(done, bins=edges)
    ax.stairs(tokens / width, edges, label="output tok/s", color="tab:blue")
    ax.set_ylabel("output tokens/s")
    twin = ax.twinx()
    twin.stairs(finished / width, edges, label="completed req/s", color="tab:orange")
    twin.set_ylabel("completed requests/s")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper right")


def _token_events(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Arrival time of each streamed chunk, weighted so a request's chunks sum to its tokens."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.success or r.start_s is None:
            continue
        if r.ttft_s is None:  # not streamed: all tokens land at the end
            if r.end_s is not None and r.output_tokens:
                times.append(r.end_s)
                weights.append(r.output_tokens)
            continue
        chunk_times = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.extend(chunk_times.tolist())
        weights.extend([r.output_tokens / len(chunk_times)] * len(chunk_times))
    return np.asarray(times), np.asarray(weights)


def _plot_requests(ax: Axes, result: BenchResult) -> None:
    starts = [(r.start_s, r.end_s) for r in result.requests if r.start_s is not None]
    if starts:
        events = sorted([(s, 1) for s, _ in starts] + [(e, -1) for _, e in starts if e is not None])
        t = [0.0] + [ev[0] for ev in events]
        level = np.concatenate([[0], np.cumsum([ev[1] for ev in events])])
        ax.step(t, level, where="post", label="in flight (client)", color="tab:gray")
    series = result.metrics
    for name, color in (("num_requests_running", "tab:green"), ("num_requests_waiting", "tab:red")):
        if name in series.values:
            values = _nan(series.values[name])
            ax.plot(series.t_s, values, label=f"{name[13:]} (server)", color=color, marker=".")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8, loc="upper right")


def _nan(values: list[float | None]) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
