"""KV-cache dtypes: what each costs in quality against float32 keys and values, side by side
with llama.cpp's cache types on the same GGUF file and text, and what it buys in capacity and
speed.

    python -m bench.kv_cache [--model qwen2.5-coder-0.5b-instruct] [--tokens 2048]
        [--dtypes float32,float16,bfloat16,int8,fp8_e4m3,int4,int8/int4]
        [--peer-types f16,q8_0,q4_0,q8_0/q4_0] [--skip-speed | --skip-pool] [--out PREFIX]

A dtype ``K/V`` stores keys in K and values in V, ``DTYPE+N`` keeps the last N tokens beside
it (``--kv-cache-recent-tokens``); a peer type ``K/V`` runs ``-ctk K -ctv V``.

- Quality: the first ``--tokens`` tokens of the text in one context, teacher forced; the rows
  of its second half count, as ``llama-perplexity`` scores one chunk of ``-c --tokens``:
  perplexity, mean and 99th-percentile KL divergence and top-1 agreement against the
  float32-KV run (``quality.kv_dtype_costs``). llama.cpp: ``llama-perplexity --chunks 1 -fa on``
  with ``-ctk/-ctv f32`` saving the base logits, then each type with ``--kl-divergence``.
- Capacity: the bytes one token holds in all layers, against float32's (of a 4096-token
  sequence, whose recent tokens are held twice).
- Decode at 4k context, 8 concurrent: 8 prompts of 4096 tokens are prefilled once (timed: chunks
  of 2048 tokens); then the same prompts (their blocks found in the prefix cache) generate 64
  tokens each, in five rounds that take the dtypes in turns (one engine each, all held at once):
  output tok/s, median. That first step computes each prompt's last block again (a prefix hit
  leaves at least one token to compute, and int4 keys' blocks are 32 tokens): a decode step
  alone is timed as (generate 65 tokens - generate 1) / 64, also a median.
- A fixed 256 MiB pool and 16 concurrent requests of 1536 + 512 tokens: total output tok/s and
  preemptions.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import quality
from bench.cpu import PEERS, cpu_model
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from models.fetch import resolve_model
from models.tokenizer import Tokenizer

DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "int4", "int8/int4")
PEER_TYPES = ("f16", "q8_0", "q4_0", "q8_0/q4_0")
DECODE_SEQS = 8  # sequences decoding at once over 4096-token contexts
NUMBER = r"(-?[\d.]+(?:e[-+]?\d+)?)"  # as llama-perplexity prints them
GGUF = {
    name: f"{name}.gguf" for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
}


def peer_quality(gguf: Path, text: Path, n_ctx: int, types: list[str]) -> dict[str, dict]:
    """llama-perplexity's PPL, mean and p99 KLD and same-top share per cache type."""
    binary = PEERS / "llama-build" / "bin" / "llama-perplexity"
    common = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "--chunks", "1",
              "-t", "2", "-fa", "on"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "base.kld")
        out = _run(common + ["-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", base])
        results = {"f32": {"ppl": _number(r"Final estimate: PPL = " + NUMBER, out)}}
        for t in types:
            key, _, value = t.partition("/")
            args = ["-ctk", key, "-ctv", value or key, "--kl-divergence-base", base,
                    "--kl-divergence"]  # fmt: skip
            out = _run(common + args)
            results[t] = {
                "ppl": _number(r"Mean PPL\(Q\)\s*:\s*" + NUMBER, out),
                "kld": _number(r"Mean\s+KLD:\s*" + NUMBER, out),
                "kld_p99": _number(r"99\.0%\s+KLD:\s*" + NUMBER, out),
                "top1": _number(r"Same top p:\s*" + NUMBER, out) / 100,
            }
    return results


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:1])} failed: {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"llama-perplexity printed no {pattern!r}")
    return float(m.group(1))


def prompts_of(ids: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the text, each starting elsewhere."""
    stride = max(1, (len(ids) - length) // max(1, n - 1))
    return [ids[i * stride : i * stride + length] for i in range(n)]


def decode_speeds(base: EngineArgs, ids: list[int], kvs: list[str], repeats: int = 5) -> dict:
    """Per KV dtype, ``DECODE_SEQS`` sequences over 4096-token contexts: output tok/s
    decoding 64 tokens each (``tok_s``), the seconds of one decode step past the first
    (``step_s``) and of the prompts' first prefill (``prefill_s``, once). One engine per dtype,
    all held at once and timed in turns, round after round, so that the box's drift over the
    run (up to 15% here) falls on every dtype alike."""
    prompts = prompts_of(ids, DECODE_SEQS, 4096)
    engines = {}
    for kv in kvs:
        args = dataclasses.replace(base, **quality.kv_settings(kv), kv_cache_memory_gib=1.0,
                                   max_model_len=4224, max_num_batched_tokens=2048)  # fmt: skip
        engines[kv] = LLM(**dataclasses.asdict(args))

    def wall(kv: str, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = engines[kv].generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return time.perf_counter() - start

    prefill = {kv: wall(kv, 1) for kv in kvs}  # the prompts' blocks cached
    rates, steps = {kv: [] for kv in kvs}, {kv: [] for kv in kvs}
    for _ in range(repeats):
        for kv in kvs:
            rates[kv].append(len(prompts) * 64 / wall(kv, 64))
            steps[kv].append((wall(kv, 65) - wall(kv, 1)) / 64)
    return {
        kv: {
            "tok_s": statistics.median(rates[kv]),
            "step_s": statistics.median(steps[kv]),
            "prefill_s": prefill[kv],
        }
        for kv in kvs
    }


def small_pool(base: EngineArgs, ids: list[int], kv: str) -> dict:
    """16 requests of 1536 prompt + 512 output tokens at once in a 256 MiB pool."""
    args = dataclasses.replace(base, **quality.kv_settings(kv), kv_cache_memory_gib=0.25,
                               max_model_len=2048, max_num_batched_tokens=2048)  # fmt: skip
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts_of(ids, 16, 1536), params)
    wall = time.perf_counter() - start
    registry = llm.engine.metrics.registry
    preempted = registry.get_sample_value("kvserve:num_preemptions_total", {"mode": "recompute"})
    return {
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "preemptions": int(preempted or 0),
        "seqs_fit": llm.engine.cache_config.num_blocks[0] * args.block_size // 2048,
        "wall_s": wall,
    }


def report(args, costs, peer, capacity, decode, pool) -> str:
    n = args.tokens
    lines = [
        f"# KV-cache dtypes on {args.model}",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, 2 threads; "
        f"`python -m bench.kv_cache {' '.join(args.argv)}`",
        "",
        f"Quality: the first {n} tokens of `{args.text}`, rows {n // 2 + 1}..{n - 1} (the "
        f"second half, as `llama-perplexity -c {n} --chunks 1` scores), against float32 K/V.",
        "",
        "| server | KV dtype | bytes/token | vs float32 | perplexity | mean KLD | p99 KLD | "
        "top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fp32 = capacity["float32"]
    for kv, c in costs.items():
        lines.append(
            f"| kvserve | {kv} | {capacity[kv]:,} | {fp32 / capacity[kv]:.2f}x | "
            f"{c.perplexity:.4f} | {c.kld_mean:.2e} | {c.kld_p99:.2e} | {c.top1:.2%} |"
        )
    for t, r in peer.items():
        kld = (
            f"{r['kld']:.2e} | {r['kld_p99']:.2e} | {r['top1']:.2%}" if "kld" in r else "- | - | -"
        )
        lines.append(f"| llama.cpp | {t} | | | {r['ppl']:.4f} | {kld} |")
    if decode:
        head = (
            f"Decode, {DECODE_SEQS} sequences at 4096 tokens of context, 64 tokens each "
            "(median of 5 rounds, the dtypes in turns); a decode step: (generate 65 - "
            "generate 1) / 64, the step that computes each prompt's last block again left out:"
        )
        lines += ["", head, "", f"| KV dtype | prefill of the {DECODE_SEQS} prompts, s | "
                  "output tok/s | vs float32 | decode step ms | decode tok/s | vs float32 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        f32 = decode["float32"]
        for kv, r in decode.items():
            lines.append(
                f"| {kv} | {r['prefill_s']:.1f} | {r['tok_s']:.1f} | "
                f"{r['tok_s'] / f32['tok_s']:.2f}x | "
                f"{r['step_s'] * 1e3:.1f} | {DECODE_SEQS / r['step_s']:.1f} | "
                f"{f32['step_s'] / r['step_s']:.2f}x |"
            )
    if pool:
        lines += ["", "A 256 MiB pool, 16 requests of 1536 + 512 tokens at once:", "",
                  "| KV dtype | 2k-token sequences that fit | preemptions | output tok/s | "
                  "vs float32 |", "|---|---|---|---|---|"]  # fmt: skip
        for kv, r in pool.items():
            lines.append(
                f"| {kv} | {r['seqs_fit']} | {r['preemptions']} | {r['tok_s']:.1f} | "
                f"{r['tok_s'] / pool['float32']['tok_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_cache", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--text", default="alice")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--peer-types", default=",".join(PEER_TYPES))
    p.add_argument("--speed-dtypes", default="float32,float16,int8,int4")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-pool", action="store_true", help="decode at 4k only, no small pool")
    p.add_argument("--out", default=None, help="results file prefix (.md)")
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    path = resolve_model(args.model)
    text = quality.load_text(args.text)
    ids = Tokenizer.from_dir(path).encode(text)
    base = EngineArgs(model=str(path), max_model_len=args.tokens + 16)
    dtypes = args.dtypes.split(",")
    peer = {}
    if args.peer_types and args.model in GGUF:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(text)
            f.flush()
            peer = peer_quality(PEERS / "gguf" / GGUF[args.model], Path(f.name), args.tokens,
                                args.peer_types.split(","))  # fmt: skip
        print(peer, flush=True)
    costs = quality.kv_dtype_costs(base, ids[: args.tokens], dtypes,
                                   rows=range(args.tokens // 2 + 1, args.tokens))  # fmt: skip
    print(costs, flush=True)
    from engine.capacity import make_plan

    def plan(name: str):
        settings = quality.kv_settings(name)
        block_size = EngineArgs(model=str(path), **settings).block_size  # int4 keys: 32
        return make_plan(str(path), 1, 4096, block_size, "float32",
                         kv_cache_dtype=settings["kv_cache_dtype"],
                         kv_recent_tokens=settings["kv_cache_recent_tokens"])  # fmt: skip

    capacity = {kv: plan(kv).bytes_per_full_sequence // 4096 for kv in dtypes}
    decode, pool = {}, {}
    if not args.skip_speed:
        decode = decode_speeds(base, ids, args.speed_dtypes.split(","))
        print(decode, flush=True)
        if not args.skip_pool:
            pool = {kv: small_pool(base, ids, kv) for kv in args.speed_dtypes.split(",")}
    text_out = report(args, costs, peer, capacity, decode, pool)
    print(text_out)
    if args.out:
        Path(f"{args.out}.md").write_text(text_out)  # a prefix: "-0.5b" is no suffix
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
