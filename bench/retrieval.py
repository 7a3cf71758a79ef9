"""Eviction judged by retrieval: needle accuracy and throughput of kvserve's importance policies
against its full cache, StreamingLLM's sinks and window at the same memory, and kvpress.

Accuracy: every prompt of a ``bench.needle`` dataset, greedy, under each policy at each KV
budget (a fraction of the prompt's tokens, as kvpress's compression ratio is); exact match of
the pass key. ``sink`` is the budget held by the first ``n_keep`` and the most recent tokens,
after a prefill over the whole prompt (StreamingLLM as kvpress's press runs it). ``shift`` is
a context of the budget's size: a longer prompt goes in truncated to its first ``n_keep`` and
its last tokens (kvserve's ``truncate``, what llama.cpp's server does before it shifts).
A policy named ``NAME-layer`` (``snapkv-layer``) chooses once per layer, not per KV head.

Throughput: ``--concurrent`` long prompts at once into a KV pool of ``--pool-tokens``, each
generating ``--max-tokens``: total output tokens per second, full cache against budgets.

    python -m bench.retrieval --dataset bench/results/needle-2k.json \\
        --kvpress bench/results/needle-kvpress-2026-11-26.json --out bench/results/retrieval
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from datetime import date
from pathlib import Path

from bench.needle import MAX_NEW_TOKENS, Dataset, Sample, is_correct, load
from engine import LLM, SamplingParams
from engine.core.context_overflow import DEFAULT_KEEP, ContextOverflow

POLICIES = ("snapkv", "h2o", "knorm", "sink", "shift")
BUDGETS = (0.5, 0.25)


def overflow(policy: str, budget: int) -> ContextOverflow | None:
    """A policy at a budget of ``budget`` cached tokens (0: the full cache)."""
    if not budget:
        return None
    if policy == "sink":  # any importance policy keeps exactly its sinks and window
        return ContextOverflow("knorm", DEFAULT_KEEP, kv_budget=budget, window=budget)
    if policy == "shift":  # in a context of ``budget`` tokens (``shifted``)
        return ContextOverflow("truncate", DEFAULT_KEEP)
    name, _, per = policy.partition("-")
    return ContextOverflow(name, kv_budget=budget, selection=per or None)


def engine(model: str, max_model_len: int, **kw) -> LLM:
    return LLM(model, max_model_len=max_model_len, kv_scores=True, **kw)


def accuracy(llm: LLM, samples: Sequence[Sample], policy: str, fraction: float) -> dict:
    """Greedy answers to every sample under ``policy`` at ``fraction`` of its prompt."""
    params = [
        SamplingParams(
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            overflow=overflow(policy, round(fraction * s.length)),
        )  # fmt: skip
        for s in samples
    ]
    start = time.perf_counter()
    outs = llm.generate([s.prompt_ids for s in samples], params)
    seconds = time.perf_counter() - start
    rows = [
        dict(id=s.id, depth=s.depth, answer=s.answer, text=o.outputs[0].text,
             correct=is_correct(o.outputs[0].text, s.answer))
        for s, o in zip(samples, outs)
    ]  # fmt: skip
    hits = sum(r["correct"] for r in rows)
    print(f"  {policy or 'full'} @ {fraction:g}: {hits}/{len(rows)} in {seconds:.0f} s", flush=True)
    return dict(policy=policy or "full", budget=fraction, accuracy=hits / len(rows), rows=rows)


def shifted(model: str, samples: Sequence[Sample], args, fraction: float) -> dict:
    """``accuracy`` of ``shift`` at ``fraction``: an engine whose context is the budget, one
    per prompt length."""
    rows = []
    for length in sorted({s.length for s in samples}):
        llm = engine(model, round(fraction * length))
        same = [s for s in samples if s.length == length]
        rows += accuracy(llm, same, "shift", fraction)["rows"]
    hits = sum(r["correct"] for r in rows)
    return dict(policy="shift", budget=fraction, accuracy=hits / len(rows), rows=rows)


def throughput(model: str, samples: Sequence[Sample], args, policy: str, fraction: float) -> dict:
    """``args.concurrent`` prompts at once into a pool of ``args.pool_tokens``: output tok/s.
    Without prefix caching: the prompts stand for as many different documents (the dataset's
    share their text up to the needle, and a scored policy's requests take no cached prefix)."""
    llm = engine(
        model, args.max_model_len, num_kv_blocks=args.pool_tokens // 16, block_size=16,
        max_num_seqs=args.concurrent, enable_prefix_caching=False,
    )  # fmt: skip
    chosen = [samples[i % len(samples)] for i in range(args.concurrent)]
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=0,
            ignore_eos=True,
            overflow=overflow(policy, round(fraction * s.length)),
        )  # fmt: skip
        for s in chosen
    ]
    llm.generate([chosen[0].prompt_ids[:64]], SamplingParams(max_tokens=2))  # warm up
    runs = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        outs = llm.generate([s.prompt_ids for s in chosen], params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(tokens / seconds)
    preemptions = llm.engine.scheduler.num_preemptions
    tok_s = statistics.median(runs)
    print(f"  {policy or 'full'} @ {fraction:g}: {tok_s:.1f} tok/s, {preemptions} preemptions")
    return dict(policy=policy or "full", budget=fraction, tok_s=tok_s, runs=runs,
                preemptions=preemptions)  # fmt: skip


def kvpress_table(path: str | None) -> tuple[dict[tuple[str, float], tuple], list[dict]]:
    """kvpress's accuracy by (method, budget), and its throughput runs (the last of each
    method and budget), from ``bench.kvpress_peer``'s results."""
    if not path:
        return {}, []
    data = json.loads(Path(path).read_text())
    accuracy = {}
    for row in data.get("summary", []):
        budget = round(1.0 - (row.get("ratio") or 0.0), 3)
        accuracy[(row["press"], budget)] = (row["accuracy"], row["prompts"])
    runs = {(r["press"], r["ratio"], r["output_tokens"] // r["prompts"]): r
            for r in data.get("throughput", [])}  # fmt: skip
    return accuracy, list(runs.values())


KVPRESS_NAMES = {
    "full": "none", "snapkv": "snapkv", "knorm": "knorm", "sink": "streaming_llm",
    "h2o": "observed_attention",
}  # fmt: skip


def report(
    dataset: Dataset, acc: list[dict], tput: list[dict], peer: tuple[dict, list[dict]], args
) -> str:
    peer_acc, peer_tput = peer
    peer_tput = [t for t in peer_tput if t["output_tokens"] // t["prompts"] == args.max_tokens]
    full = next((r["accuracy"] for r in acc if r["policy"] == "full"), None)
    lines = [
        f"# Needle retrieval under KV eviction ({args.model or dataset.meta.get('model')})",
        "",
        f"{date.today()}, {platform.node()} ({platform.processor() or platform.machine()}), "
        f"{len(dataset.samples)} prompts of {sorted({s.length for s in dataset.samples})} tokens, "
        f"depths {sorted({s.depth for s in dataset.samples})}; greedy, {MAX_NEW_TOKENS} tokens.",
        "",
        f"`python -m bench.retrieval {' '.join(args.argv)}`",
    ]
    if acc:
        lines += [
            "",
            "| policy | KV budget | kvserve accuracy | of the full cache | kvpress accuracy |",
            "|---|---|---|---|---|",
        ]
    for r in acc:
        theirs = peer_acc.get((KVPRESS_NAMES.get(r["policy"]), round(r["budget"] or 1.0, 3)))
        cells = [
            r["policy"], f"{r['budget']:.0%}" if r["budget"] else "100%",
            f"{r['accuracy']:.0%}", f"{r['accuracy'] / full:.0%}" if full else "-",
            "-" if theirs is None else f"{theirs[0]:.0%} (of {theirs[1]})",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if tput:
        base = next(t["tok_s"] for t in tput if t["policy"] == "full")
        lines += [
            "",
            f"Throughput: {args.concurrent} concurrent prompts, {args.max_tokens} output tokens "
            f"each, a pool of {args.pool_tokens} KV tokens, no prefix caching; median of "
            f"{args.rounds}.",
            "",
            "| policy | KV budget | output tok/s | vs full cache | preemptions |",
            "|---|---|---|---|---|",
        ]
        for t in tput:
            budget = f"{t['budget']:.0%}" if t["budget"] else "100%"
            ratio = f"{t['tok_s'] / base:.2f}x"
            cells = [t["policy"], budget, f"{t['tok_s']:.1f}", ratio, str(t["preemptions"])]
            lines.append("| " + " | ".join(cells) + " |")
        for t in peer_tput:
            budget = f"{1 - t['ratio']:.0%}"
            ratio = f"{t['output_tok_s'] / base:.2f}x"
            cells = [f"kvpress {t['press']}", budget, f"{t['output_tok_s']:.1f}", ratio, "-"]
            lines.append("| " + " | ".join(cells) + " |")
        if peer_tput:
            lines += [
                "",
                "kvpress: the same prompts one at a time (it serves a batch of one), "
                f"{peer_tput[-1]['output_tokens'] // peer_tput[-1]['prompts']} output tokens "
                f"each, {peer_tput[-1].get('threads')} torch threads, as `bench.kvpress_peer "
                "throughput` records it.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", default=None, help="default: the dataset's")
    parser.add_argument("--keys", nargs="+", help="only the prompts of these pass keys")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kvpress", help="bench.kvpress_peer's results, shown beside ours")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pool-tokens", type=int, default=6656)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", required=True, help="path without suffix: .md and .json")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    dataset = load(args.dataset)
    if args.keys:
        dataset.samples[:] = [s for s in dataset.samples if s.answer in args.keys]
    model = args.model or dataset.meta["model"]
    # Room for every prompt at once: the full cache is measured without preemptions.
    blocks = sum(-(-(s.length + MAX_NEW_TOKENS) // 16) for s in dataset.samples)
    acc = []
    if args.accuracy:
        llm = engine(model, args.max_model_len, num_kv_blocks=blocks, block_size=16)
        print("accuracy:", flush=True)
        acc.append(accuracy(llm, dataset.samples, "", 0.0))
        for b in args.budgets:
            for p in args.policies:
                if p == "shift":
                    acc.append(shifted(model, dataset.samples, args, b))
                else:
                    acc.append(accuracy(llm, dataset.samples, p, b))
        del llm
    tput = []
    if args.throughput:
        print("throughput:", flush=True)
        tput = [throughput(model, dataset.samples, args, "", 0.0)]
        tput += [throughput(model, dataset.samples, args, "snapkv", b) for b in args.budgets]
    text = report(dataset, acc, tput, kvpress_table(args.kvpress), args)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps(dict(accuracy=acc, throughput=tput), indent=1))
    print(text)


if __name__ == "__main__":
    main()
