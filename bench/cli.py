"""`kvserve bench`: its flags, and the command that runs a load test and reports it.

``add_workload_arguments`` and ``workload_from_args`` are shared with `kvserve tune`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any

from bench.loadtest import (
    DEFAULT_BASE_URL,
    ENDPOINT_PATHS,
    SLO,
    BenchConfig,
    BenchError,
    BenchResult,
    format_summary,
    run_benchmark,
    write_result_json,
)
from bench.plots import save_plots


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve bench",
        description="Load-test an OpenAI-compatible server (kvserve, vLLM, llama.cpp).",
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL)
    target.add_argument("--model", help="default: the first model of GET /models")
    target.add_argument("--api-key", help="sent as a Bearer token")
    target.add_argument(
        "--allow-remote", action="store_true", help="allow a target whose host is not loopback"
    )
    add_workload_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--result-json", metavar="PATH")
    out.add_argument("--plot-dir", metavar="DIR")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def add_workload_arguments(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """The flags that describe the load, shared by `kvserve bench` and `kvserve tune`.

    ``seed=False`` leaves ``--seed`` to a parser that already has one (the engine's flags).
    """
    _add_request_arguments(p.add_argument_group("requests"))
    _add_load_arguments(p.add_argument_group("load"), seed)
    _add_prompt_arguments(p.add_argument_group("prompts"))
    meas = p.add_argument_group("measurement")
    meas.add_argument("--slo", type=SLO.parse, default=SLO(), metavar="ttft=MS,tpot=MS[,e2e=MS]")
    meas.add_argument(
        "--scrape-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="/metrics sampling period; 0 turns scraping off",
    )


def _add_request_arguments(req) -> None:
    req.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    req.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="one JSON reply per request (no TTFT/ITL)",
    )
    req.add_argument("--request-timeout", type=float, default=300.0, metavar="S")


def _add_load_arguments(load, seed: bool) -> None:
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument(
        "--duration",
        type=float,
        default=600.0,
        metavar="S",
        help="stop (cancelling what still runs) after this long",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="requests/s with gamma inter-arrivals; default: all at once",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        metavar="B",
        help="gamma shape: 1 Poisson, <1 burstier, >1 more even",
    )
    load.add_argument("--max-concurrency", type=int, metavar="N")
    if seed:
        load.add_argument("--seed", type=int, default=0)


def _add_prompt_arguments(work) -> None:
    work.add_argument("--input-len", type=int, default=256)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument(
        "--input-len-range",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="input lengths uniform in len*(1-RATIO)..len*(1+RATIO)",
    )
    work.add_argument("--output-len-range", type=float, default=0.0, metavar="RATIO")
    work.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of a prefix shared by synthetic prompts",
    )
    work.add_argument(
        "--prefix-fraction",
        type=float,
        default=1.0,
        metavar="F",
        help="share of the synthetic prompts that start with the --prefix-len prefix",
    )
    work.add_argument(
        "--turns",
        type=int,
        default=1,
        help="synthetic chat sessions of this many turns, each resending its history "
        "(--num-prompts counts turns)",
    )
    work.add_argument(
        "--session-history",
        type=int,
        default=0,
        metavar="N",
        help="tokens of each session's own text ahead of its first turn (LMCache's "
        "multi-round QA --user-history-prompt)",
    )
    work.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help='lines with "prompt" or "messages", optional "max_tokens"',
    )
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="omit the ignore_eos extension (servers that reject it)",
    )
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        metavar="JSON",
        help="fields merged into every request body",
    )
    work.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="do not size prompts with the server's /tokenize",
    )


def workload_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """BenchConfig fields from the flags of ``add_workload_arguments``."""
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return dict(
        endpoint=args.endpoint,
        stream=args.stream,
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        input_len_range=args.input_len_range,
        output_len_range=args.output_len_range,
        prefix_len=args.prefix_len,
        prefix_fraction=args.prefix_fraction,
        turns=args.turns,
        session_history=args.session_history,
        dataset=args.dataset,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        slo=args.slo,
        scrape_interval_s=args.scrape_interval,
        request_timeout_s=args.request_timeout,
        calibrate=args.calibrate,
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        allow_remote=args.allow_remote,
        show_progress=args.progress,
        **workload_from_args(args),
    )


def main(argv: list[str]) -> int:
    """``kvserve bench``: 0 when some request succeeded, 1 when none did, 2 on bad usage."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        result = asyncio.run(run_benchmark(config))
    except (BenchError, ValueError) as e:
        print(f"kvserve bench: {e}", file=sys.stderr)
        return 2
    print(format_summary(result))
    if args.result_json:
        print(f"result: {write_result_json(result, args.result_json)}")
    if args.plot_dir:
        for path in save_plots(result, args.plot_dir):
            print(f"plot: {path}")
    if result.summary.completed:
        return 0
    # A table of n/a alone does not say why; the usual cause is a wrong URL, seen in one line.
    print(f"kvserve bench: {no_success_reason(result)}", file=sys.stderr)
    return 1


def no_success_reason(result: BenchResult) -> str:
    """Why no request completed, from the commonest failure (a sample of it names the cause)."""
    s, url = result.summary, result.config.endpoint_url
    if not s.failed:
        return f"no request completed within --duration {result.config.duration_s:g}s"
    kind = max(s.failed_by_status, key=lambda k: s.failed_by_status[k])
    sample = next(r for r in result.requests if not r.success and (r.failure or "unknown") == kind)
    error = " ".join((sample.error or "").split())[:200]
    if kind.isdigit():
        reason = f"HTTP {kind} from {url}" + (f" ({error})" if error else "")
    elif kind == "connection":
        reason = f"cannot connect to {url} ({error})"
    else:
        reason = f"{kind} error from {url}: {error}"
    hint = "; is --base-url right?" if kind in ("404", "405", "connection") else ""
    if s.cancelled or s.not_sent:
        head = f"no request completed ({s.failed} failed, {s.cancelled + s.not_sent} cut short)"
    else:
        head = f"all {s.failed} requests failed"
    return f"{head}: {reason}{hint}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
