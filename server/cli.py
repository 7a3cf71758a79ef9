"""The `kvserve` command: serve, fetch, convert, and the subcommands other modules own."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineArgs
from engine.overflow import CONTEXT_POLICIES, PREEMPTION_MODES

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger("kvserve")

# Subcommands that parse their own argv, as "module:function".
PASS_THROUGH = {
    "bench": ("server.bench:main", "benchmark a running server"),
    "tune": ("server.tune:main", "search engine settings for a workload"),
    "plan": ("engine.plan:main", "plan KV-cache capacity for a model and device"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags that map onto EngineArgs; a new engine option is added here and below."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="model folder, or an alias from `fetch`")
    g.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: by device)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per pool")
    size.add_argument(
        "--kv-cache-memory", type=float, default=None, metavar="GIB", help="KV cache size in GiB"
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step"
    )
    g.add_argument(
        "--attention-backend", choices=["torch", "triton"], default=None, help="default: by device"
    )
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    o = parser.add_argument_group("overflow policies (a request may override the context one)")
    o.add_argument(
        "--context-overflow",
        choices=CONTEXT_POLICIES,
        default="error",
        help="when prompt + generation reach --max-model-len: error (400), truncate the prompt, "
        "stop (finish_reason length), shift the cache (llama.cpp), sink (StreamingLLM)",
    )
    o.add_argument(
        "--context-n-keep", type=int, default=None, help="tokens kept at the start (default 4)"
    )
    o.add_argument(
        "--context-n-discard",
        type=int,
        default=None,
        help="tokens a shift discards (default: half the rest; sink: one block)",
    )
    o.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="recompute",
        help="how a running request gives up its KV blocks when the pool runs out",
    )
    o.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        metavar="GIB",
        help="host memory for swapped-out KV blocks (with --preemption-mode swap)",
    )
    o.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="waiting requests beyond which new ones get 429 (default: unbounded)",
    )
    o.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="waiting prompt tokens beyond which new requests get 429",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        block_size=ns.block_size,
        num_kv_blocks=ns.num_kv_blocks,
        kv_cache_memory_gib=ns.kv_cache_memory,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        attention_backend=ns.attention_backend,
        seed=ns.seed,
        context_overflow=ns.context_overflow,
        context_n_keep=ns.context_n_keep,
        context_n_discard=ns.context_n_discard,
        preemption_mode=ns.preemption_mode,
        swap_space_gib=ns.swap_space,
        max_queue_len=ns.max_queue_len,
        max_queued_tokens=ns.max_queued_tokens,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    http = serve.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument(
        "--served-model-name", default=None, help="the `model` clients ask for (default: folder)"
    )
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])

    fetch = sub.add_parser("fetch", help="download and convert a model by alias")
    fetch.add_argument("alias")

    convert = sub.add_parser("convert", help="convert a GGUF file into a model folder")
    convert.add_argument("gguf", type=Path, metavar="FILE.gguf")
    convert.add_argument("out_dir", type=Path, metavar="OUT_DIR")

    for name, (_, help_text) in PASS_THROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def run_pass_through(name: str, argv: list[str]) -> int | None:
    module_name, func = PASS_THROUGH[name][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        sys.exit(f"kvserve: `{name}` is not available in this install ({module_name} is missing)")
    return getattr(module, func)(argv)


def log_startup(engine: AsyncEngine, served_model_name: str, block_size: int) -> None:
    stats = engine.stats()
    blocks = stats["kv_total_blocks"]
    log.info("model %s, served as %r", engine.model_name, served_model_name)
    log.info(
        "max_model_len %d; KV cache %d blocks of %d tokens: %d token slots, %d sequences at "
        "max_model_len",
        engine.max_model_len,
        blocks,
        block_size,
        blocks * block_size,
        blocks // max(1, -(-engine.max_model_len // block_size)),
    )


def serve(ns: argparse.Namespace, args: EngineArgs) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from server.app import build_app

    engine = AsyncEngine(args)
    try:
        served = ns.served_model_name or engine.model_name
        app = build_app(engine, served, extra_model_names=[ns.model, Path(ns.model).name])
        log_startup(engine, served, args.block_size)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if argv and argv[0] in PASS_THROUGH:
        return run_pass_through(argv[0], argv[1:]) or 0
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        try:
            args = engine_args_from(ns)
        except ValueError as e:
            parser.error(str(e))
        return serve(ns, args)
    if ns.command == "fetch":
        from models.fetch import fetch

        print(fetch(ns.alias, progress=True))
        return 0
    if ns.command == "convert":
        from models.gguf_import import convert_gguf

        print(convert_gguf(ns.gguf, ns.out_dir, progress=True))
        return 0
    raise AssertionError(ns.command)


if __name__ == "__main__":
    sys.exit(main())
