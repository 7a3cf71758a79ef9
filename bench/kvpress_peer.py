"""NVIDIA's kvpress on the needle dataset (``bench/needle.py``): the peer that kvserve's KV-cache
eviction is judged against.

kvpress pins transformers below 5.3, so this runs in its own environment (``make kvpress``
builds ``.venv-kvpress``) and reads only the dataset's token ids; it imports nothing of kvserve
but the stdlib-only ``bench.needle``. The model is the GGUF file kvserve serves, dequantized by
transformers to float32 on the CPU.

Each prompt is prefilled whole under the press, question included, so the compressed cache covers
the question too and the first answer token comes from the last prompt row computed before any
eviction (as kvserve does; kvpress's own pipeline compresses only a context and feeds the
question after). Then greedy decoding on the compressed cache, at positions that go on from the
prompt's length, as kvpress's pipeline does.

    make kvpress
    .venv-kvpress/bin/python -m bench.kvpress_peer accuracy \\
        --dataset bench/results/needle-2k.json --out bench/results/needle-kvpress.json
    .venv-kvpress/bin/python -m bench.kvpress_peer throughput --presses none snapkv \\
        --ratios 0.5 --limit 8 --dataset bench/results/needle-2k.json \\
        --out bench/results/needle-kvpress.json
    .venv-kvpress/bin/python -m bench.kvpress_peer report --out bench/results/needle-kvpress.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import transformers
from kvpress import KnormPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from bench.needle import Sample, is_correct, load

GGUF = Path("~/.cache/kvserve/gguf/qwen2.5-coder-0.5b-instruct.gguf").expanduser()
# ObservedAttentionPress (H2O's accumulated attention) reads the attention matrix, which only
# the eager implementation returns; the others work from keys, queries and positions.
PRESSES = {
    "snapkv": SnapKVPress,
    "knorm": KnormPress,
    "streaming_llm": StreamingLLMPress,
    "observed_attention": ObservedAttentionPress,
}
EAGER = {"observed_attention"}
RATIOS = (0.5, 0.75)


def make_press(name: str, ratio: float):
    """The press with its defaults but the ratio, or None for the full cache."""
    return None if name == "none" else PRESSES[name](compression_ratio=ratio)


def press_params(name: str) -> dict[str, Any]:
    return {} if name == "none" else dataclasses.asdict(PRESSES[name]())


def load_model(gguf: Path):
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


class KeptIndices:
    """Records, per layer, the positions a scorer press keeps: the same top-k over the same
    scores that ``ScorerPress.compress`` takes next."""

    def __init__(self, press) -> None:
        self.layers: list[torch.Tensor] = []  # (kv_heads, n_kept), sorted
        score = press.score

        def recording(module, hidden_states, keys, *args, **kwargs):
            scores = score(module, hidden_states, keys, *args, **kwargs)
            n_kept = max(1, int(keys.shape[2] * (1 - press.compression_ratio)))
            self.layers.append(scores[0].topk(n_kept, dim=-1).indices.sort(dim=-1).values)
            return scores

        press.score = recording

    def kept_fraction(self, start: int, end: int) -> float:
        """The share of the span's keys kept, over every layer and KV head."""
        kept = [((idx >= start) & (idx < end)).sum().item() for idx in self.layers]
        heads = self.layers[0].shape[0]
        return sum(kept) / ((end - start) * heads * len(self.layers))


@torch.inference_mode()
def generate(model, press, ids: Sequence[int], max_new_tokens: int, stop: set[int]):
    """Greedy tokens after ``ids`` with the cache the press leaves, and the prefill and decode
    times (seconds) apart."""
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1).logits
    token = int(logits[0, -1].argmax())
    prefill_s = time.perf_counter() - start
    kept = cache.layers[0].keys.shape[2]
    out = [token]
    start = time.perf_counter()
    for i in range(max_new_tokens - 1):
        if token in stop:
            break
        position = torch.tensor([[len(ids) + i]])
        logits = model(torch.tensor([[token]]), past_key_values=cache, position_ids=position).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
    return out, prefill_s, time.perf_counter() - start, kept


def set_attention(model, name: str) -> None:
    model.set_attn_implementation("eager" if name in EAGER else "sdpa")


def run_accuracy(model, tokenizer, samples: list[Sample], name: str, ratio: float, max_new: int):
    set_attention(model, name)
    rows = []
    for sample in samples:
        press = make_press(name, ratio)
        recorder = KeptIndices(press) if press is not None else None
        out, prefill_s, decode_s, kept = generate(
            model, press, sample.prompt_ids, max_new, set(_eos(tokenizer))
        )
        text = tokenizer.decode(out, skip_special_tokens=True)
        row = {
            "press": name,
            "ratio": ratio,
            "id": sample.id,
            "length": sample.length,
            "depth": sample.depth,
            "answer": sample.answer,
            "generated_ids": out,
            "text": text,
            "correct": is_correct(text, sample.answer),
            "kv_kept": kept,
            "needle_kept": (
                recorder.kept_fraction(sample.needle_start, sample.needle_end) if recorder else 1.0
            ),
            "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tokens": len(out) - 1,
            "threads": torch.get_num_threads(),
        }
        rows.append(row)
        print(
            f"{name} r={ratio} {sample.id}: {text!r} {'ok' if row['correct'] else 'MISS'} "
            f"needle kept {row['needle_kept']:.2f} prefill {prefill_s:.2f}s",
            flush=True,
        )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["decode_tokens"] for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    return {
        "press": rows[0]["press"],
        "ratio": rows[0]["ratio"],
        "prompts": len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "needle_kept": statistics.mean(r["needle_kept"] for r in rows),
        "median_prefill_s": statistics.median(r["prefill_s"] for r in rows),
        "decode_tok_s": tokens / decode_s if decode_s else None,
    }


def run_throughput(model, samples: list[Sample], name: str, ratio: float, max_new: int):
    """Prompts one after another (kvpress works on one sequence at a time), every one decoding
    ``max_new`` tokens whatever it says."""
    set_attention(model, name)
    prefill = decode = 0.0
    tokens = 0
    start = time.perf_counter()
    for i, sample in enumerate(samples):
        out, prefill_s, decode_s, _ = generate(
            model, make_press(name, ratio), sample.prompt_ids, max_new, set()
        )
        prefill += prefill_s
        decode += decode_s
        tokens += len(out)
        print(
            f"throughput {name} r={ratio} prompt {i + 1}/{len(samples)}: {len(out)} tokens, "
            f"prefill {prefill_s:.2f}s decode {decode_s:.2f}s",
            flush=True,
        )
    wall = time.perf_counter() - start
    return {
        "press": name,
        "ratio": ratio,
        "prompts": len(samples),
        "prompt_tokens": sum(s.length for s in samples),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": tokens / wall,
        "prefill_s": round(prefill, 3),
        "decode_tok_s": (tokens - len(samples)) / decode,
        "threads": torch.get_num_threads(),
    }


def _eos(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.machine()}, {os.cpu_count()} cores"


def meta(argv: list[str], dataset_path: str, gguf: Path, note: str | None) -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.kvpress_peer " + shlex.join(argv),
        "note": note,
        "dataset": dataset_path,
        "model": str(gguf.name),
        "dtype": "float32",
        "device": f"cpu ({_cpu()})",
        "versions": {p: version(p) for p in ("kvpress", "transformers", "torch")},
        "presses": {
            name: {"class": cls.__name__, "defaults": press_params(name)}
            for name, cls in PRESSES.items()
        },
        "attention": {name: "eager" if name in EAGER else "sdpa" for name in PRESSES},
    }


def _write(path: Path, head: dict[str, Any], rows=(), throughput=()) -> None:
    """Merges new rows (by press, ratio and prompt) and throughput runs (by press, ratio and
    threads) into the file, with the summary recomputed from all its rows, and writes at once,
    so a run cut short keeps what it measured and a later run can add prompts."""
    data = json.loads(path.read_text()) if path.exists() else {}
    run = {k: head[k] for k in ("command", "note", "date")}
    runs = [r for r in data.get("meta", {}).get("runs", []) if r != run] + [run]
    data["meta"] = {**{k: v for k, v in head.items() if k not in run}, "runs": runs}
    new = {(r["press"], r["ratio"], r["id"]) for r in rows}
    data["rows"] = [r for r in data.get("rows", []) if (r["press"], r["ratio"], r["id"]) not in new]
    data["rows"] += rows
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in data["rows"]:
        groups.setdefault((row["press"], row["ratio"]), []).append(row)
    data["summary"] = [summarize(group) for group in groups.values()]
    new = {(t["press"], t["ratio"], t["threads"]) for t in throughput}
    old = [
        t for t in data.get("throughput", []) if (t["press"], t["ratio"], t["threads"]) not in new
    ]
    data["throughput"] = old + list(throughput)
    path.write_text(json.dumps(data, indent=1) + "\n")


def markdown(data: dict[str, Any]) -> str:
    """The summary and throughput of a results file as markdown tables."""
    lines = [
        "| press | KV kept | prompts | exact match | needle keys kept | median prefill s | "
        "decode tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in data.get("summary", []):
        lines.append(
            f"| {s['press']} | {1 - s['ratio']:.0%} | {s['prompts']} | {s['accuracy']:.0%} | "
            f"{s['needle_kept']:.0%} | {s['median_prefill_s']:.1f} | {s['decode_tok_s']:.2f} |"
        )
    if data.get("throughput"):
        lines += [
            "",
            "| press | KV kept | threads | prompts x new tokens | output tok/s | wall s | "
            "decode tok/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in data["throughput"]:
            new = t["output_tokens"] // t["prompts"]
            lines.append(
                f"| {t['press']} | {1 - t['ratio']:.0%} | {t['threads']} | "
                f"{t['prompts']} x {new} | {t['output_tok_s']:.2f} | {t['wall_s']:.0f} | "
                f"{t['decode_tok_s']:.2f} |"
            )
    return "\n".join(lines)


def configs(names: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float]]:
    """(press, ratio) pairs, the full cache first and once."""
    full = [("none", 0.0)] if "none" in names else []
    return full + [(n, r) for n in names if n != "none" for r in ratios]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["accuracy", "throughput", "report"])
    parser.add_argument("--dataset", help="not needed to report")
    parser.add_argument("--out", required=True)
    parser.add_argument("--presses", nargs="+", default=["none", *PRESSES])
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--keys", type=int, nargs="+", help="only these pass keys (0: the first)")
    parser.add_argument("--limit", type=int, help="the first N prompts only")
    parser.add_argument("--max-new-tokens", type=int, help="default: the dataset's, or 128")
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--note", help="what else ran on the machine, say")
    # On a busy machine one thread decodes many times faster: a thread team waits at every
    # small op for a member the scheduler has put aside.
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.mode == "report":
        print(markdown(json.loads(out.read_text())))
        return
    if args.dataset is None:
        parser.error(f"{args.mode} needs --dataset")
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load(args.dataset)
    samples = dataset.samples
    if args.keys is not None:
        keys = list(dict.fromkeys(s.answer for s in samples))
        samples = [s for s in samples if keys.index(s.answer) in args.keys]
    samples = samples[: args.limit]
    model, tokenizer = load_model(args.gguf)
    head = meta(argv, args.dataset, args.gguf, args.note)
    for name, ratio in configs(args.presses, args.ratios):
        if args.mode == "accuracy":
            max_new = args.max_new_tokens or dataset.meta["max_new_tokens"]
            rows = run_accuracy(model, tokenizer, samples, name, ratio, max_new)
            _write(out, head, rows=rows)
            print(json.dumps(summarize(rows)), flush=True)
        else:
            result = run_throughput(model, samples, name, ratio, args.max_new_tokens or 128)
            _write(out, head, throughput=[result])
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
