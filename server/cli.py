"""The `kvserve` command: serve, plan, fetch, convert, and the client tools' subcommands.

Engine flags come from ``engine.args`` (each setting declared once). Client tools (``bench``,
``tune``) live in the ``bench`` package and are found through the ``kvserve.commands`` entry
points, so the server never imports them; they parse their own arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from engine.args import EngineArgs, add_cli_args, from_cli_args
from engine.capacity import capacity
from server.args import API_KEY_ENV, ServerArgs

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger("kvserve")

PLAN_SETTINGS = (
    "model", "kv_cache_memory_gib", "max_model_len", "block_size", "dtype", "tensor_parallel_size",
    "quantization", "kv_cache_dtype", "kv_cache_dtype_skip_layers", "kv_cache_recent_tokens",
    "kv_host_cache_gib", "kv_disk_cache_gib",
)  # fmt: skip


def client_commands() -> dict[str, EntryPoint]:
    """Subcommands other packages register under the ``kvserve.commands`` entry points."""
    return {ep.name: ep for ep in entry_points(group="kvserve.commands")}


def build_parser(client: dict[str, EntryPoint] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_cli_args(serve)
    add_cli_args(serve, cls=ServerArgs, required=())

    plan = sub.add_parser(
        "plan",
        help="plan KV-cache capacity for a model and device",
        description="What a KV-cache budget holds for a model, from its config.json alone: the "
        "numbers `kvserve serve` logs at start-up.",
    )
    add_cli_args(
        plan,
        PLAN_SETTINGS,
        defaults={"dtype": "bfloat16"},
        required=("model", "kv_cache_memory_gib"),
    )

    fetch = sub.add_parser("fetch", help="download and convert a model by alias")
    fetch.add_argument("alias")

    convert = sub.add_parser("convert", help="convert a GGUF file into a model folder")
    convert.add_argument("gguf", type=Path, metavar="FILE.gguf")
    convert.add_argument("out_dir", type=Path, metavar="OUT_DIR")

    for name, ep in (client or {}).items():
        sub.add_parser(name, help=f"client tool ({ep.value}); see `kvserve {name} --help`")
    return parser


def fail(command: str, error: BaseException | str) -> NoReturn:
    """Exit with status 2 (argparse's) after one line on stderr: a user's mistake (a bad flag, a
    missing or unsupported model) reads better as its message than as a traceback or the
    several-line usage that ``parser.error`` prints first."""
    if isinstance(error, OSError) and error.filename and error.strerror:
        message = f"{error.filename}: {error.strerror}"  # not "[Errno 2] ...: 'x'"
    else:
        message = str(error).strip() or type(error).__name__
    print(f"kvserve {command}: {message}", file=sys.stderr)
    raise SystemExit(2)


def engine_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> EngineArgs:
    """The parsed engine flags, checked; a bad value is a usage error (exit status 2)."""
    try:
        return from_cli_args(ns)
    except ValueError as e:
        fail(ns.command, e)


def server_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    """The parsed server flags, checked; API keys from the environment when no flag gives one."""
    keys = tuple(ns.api_key or ())
    if not keys and os.environ.get(API_KEY_ENV):
        keys = (os.environ[API_KEY_ENV],)
    try:
        return from_cli_args(ns, ServerArgs, api_key=keys)
    except ValueError as e:
        fail(ns.command, e)


def run_client_command(ep: EntryPoint, argv: list[str]) -> int:
    try:
        main = ep.load()
    except ModuleNotFoundError as e:
        sys.exit(f"kvserve: `{ep.name}` needs the bench extra (pip install 'kvserve[bench]'): {e}")
    return main(argv) or 0


def log_startup(engine: AsyncEngine, served_model_name: str) -> None:
    """The engine has logged its capacity table; the name it is served as, and how many
    full-length sequences fit at once (the fullest group decides), from that same table."""
    rows = capacity(engine.cache_config, engine.max_model_len)
    log.info(
        "model %s, served as %r: %d sequences of max_model_len %d fit in the KV cache",
        engine.model_name,
        served_model_name,
        min(r.max_seqs_at_full_len for r in rows),
        engine.max_model_len,
    )


def check_model(args: EngineArgs) -> None:
    """Resolve and read the model before any engine starts, so a wrong ``--model`` (a GGUF file,
    a folder without config.json, an unknown architecture), a KV dtype its cache rows cannot
    take or a --context-n-discard its context cannot hold is one line, not a traceback from deep
    in the engine (or from every tensor-parallel rank)."""
    from models.config import ModelConfig
    from models.fetch import resolve_model
    from models.loader import model_class

    try:
        cfg = ModelConfig.from_dir(resolve_model(args.model))
        groups = args.runner_config(cfg).kv_cache_groups(model_class(cfg), cfg)
        sum(g.bytes_per_token for g in groups)
        args.default_overflow().check_limit(args.max_model_len or cfg.max_position_embeddings)
    except (ValueError, OSError, RuntimeError) as e:
        fail("serve", e)


def serve(args: EngineArgs, http: ServerArgs) -> int:
    from engine.async_engine import AsyncEngine
    from server import shutdown
    from server.app import build_app

    engine = AsyncEngine(args)
    try:
        app = build_app(engine, http, extra_model_names=[args.model, Path(args.model).name])
        server = app.state.server
        log_startup(engine, server.served_model_name)
        if http.api_key:
            log.info("API keys required on every route but /health, /ready and /metrics")
        elif http.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s without API keys (--api-key)", http.host)
        shutdown.run(app, server, http.host, http.port, http.log_level, http.shutdown_timeout)
    finally:
        engine.shutdown(timeout=shutdown.FLUSH_S)
    return 0


def plan(args: EngineArgs) -> int:
    from engine.capacity import format_plan, make_plan

    result = make_plan(
        args.model, args.kv_cache_memory_gib, args.max_model_len, args.block_size, args.dtype,
        args.tensor_parallel_size, quantization=args.quantization,
        kv_cache_dtype=args.kv_dtype(args.dtype),
        kv_skip_sliding=args.kv_cache_dtype_skip_layers == "sliding_window",
        kv_recent_tokens=args.kv_cache_recent_tokens,
        kv_host_cache_gib=args.kv_host_cache_gib,
        kv_disk_cache_gib=args.kv_disk_cache_gib,
    )  # fmt: skip
    print(format_plan(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    client = client_commands()
    if argv and argv[0] in client:
        return run_client_command(client[argv[0]], argv[1:])
    parser = build_parser(client)
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        return serve_command(parser, ns)
    if ns.command == "plan":
        args = engine_args(parser, ns)
        try:
            return plan(args)
        except (ValueError, OSError) as e:
            fail("plan", e)
    if ns.command == "fetch":
        from models.fetch import fetch

        try:
            print(fetch(ns.alias, progress=True))
        except (ValueError, OSError, RuntimeError) as e:  # unknown alias, download, disk
            fail("fetch", e)
        return 0
    if ns.command == "convert":
        return convert_command(ns.gguf, ns.out_dir)
    raise AssertionError(ns.command)


def serve_command(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    args = engine_args(parser, ns)
    from engine.worker.tp_workers import launched, run_rank

    try:
        launch = launched(args.tensor_parallel_size)
    except ValueError as e:
        fail("serve", e)
    check_model(args)
    if launch is not None and launch.tp.rank > 0:  # started by torchrun: rank 0 serves
        run_rank(args.runner_config(), launch)
        return 0
    return serve(args, server_args(parser, ns))


def convert_command(gguf: Path, out_dir: Path) -> int:
    from models.gguf_import import convert_gguf

    if not gguf.is_file():
        fail("convert", f"no such file: {gguf}")
    with gguf.open("rb") as f:
        # The reader's own complaint about a non-GGUF file is a numpy dtype error.
        if f.read(4) != b"GGUF":
            fail("convert", f"{gguf} is not a GGUF file (no GGUF magic at its start)")
    try:
        print(convert_gguf(gguf, out_dir, progress=True))
    except (ValueError, OSError) as e:  # not a GGUF file, unsupported architecture, disk
        fail("convert", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
