"""Engine decode step on a GPU, eager against CUDA graphs, next to its roofline.

    python -m bench.decode_step [--models smollm2-135m llama3-8b-4l gemma3-270m]
        [--batch 1 8 64] [--prompt 512] [--tokens 64] [--out PREFIX]

Random-weight bf16 checkpoints at real shapes (built with transformers, so nothing is
downloaded). Per model, batch and mode: ms per decode step ((time of prompt + N tokens - time of
prompt + 1 token) / (N - 1), medians), output tokens/s, host launches per decode step (CUDA
runtime launch calls seen by the profiler; a graph replay is one), and the roofline: weight bytes
plus the step's K/V bytes over the device's measured read bandwidth. The two modes read the same
prompts without a prefix cache (a cached prefix would make the second mode's prefill another
computation), and their greedy tokens and those tokens' logprobs must be equal, bit for bit:
the command exits 1 when they are not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.kernel_speed import Timer, read_bandwidth
from engine import LLM, SamplingParams

SHAPES = {
    "smollm2-135m": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True)),
    "llama3-8b-4l": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2.5-1.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        max_position_embeddings=32768, query_pre_attn_scalar=256, tie_word_embeddings=True)),
}  # fmt: skip


def build_checkpoint(name: str, folder: Path) -> Path:
    import transformers

    config_class, model_class, fields = SHAPES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**fields)
    with torch.device("cuda"):
        model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    path = folder / name
    model.save_pretrained(path)
    return path


@dataclass
class Row:
    model: str
    batch: int
    mode: str
    ms_per_step: float
    tokens_per_s: float
    launches_per_step: float
    roofline_ms: float


def _generate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """Seconds, and per prompt its greedy tokens with their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    chosen = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    return time.perf_counter() - start, chosen


def step_ms(llm: LLM, prompts: list[list[int]], tokens: int, repeats: int) -> tuple[float, list]:
    full, short = [], []
    for _ in range(repeats):
        seconds, ids = _generate(llm, prompts, tokens)
        full.append(seconds)
        short.append(_generate(llm, prompts, 1)[0])
    return (statistics.median(full) - statistics.median(short)) / (tokens - 1) * 1e3, ids


def _launches(llm: LLM, prompts: list[list[int]], tokens: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _generate(llm, prompts, tokens)
    names = ("LaunchKernel", "GraphLaunch", "cuLaunch")
    return sum(e.count for e in prof.key_averages() if any(n in e.key for n in names))


def launches_per_step(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    return (_launches(llm, prompts, tokens) - _launches(llm, prompts, 1)) / (tokens - 1)


def roofline_ms(llm: LLM, batch: int, context: int, bandwidth: float) -> float:
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    kv = 0
    for group in llm.engine.runner.groups:
        window = group.spec.window or context
        kv += batch * min(window, context) * group.bytes_per_token
    return (weights + kv) / bandwidth * 1e3


def bench_model(name: str, args, folder: Path, bandwidth: float) -> tuple[list[Row], bool]:
    path = build_checkpoint(name, folder)
    vocab = SHAPES[name][2]["vocab_size"]
    rows, tokens_by_mode = [], {}
    for mode in ("eager", "graphs"):
        llm = LLM(
            str(path), dtype="bfloat16", max_model_len=args.prompt + args.tokens + 16,
            max_num_seqs=max(args.batch), max_num_batched_tokens=max(2048, args.prompt),
            enforce_eager=mode == "eager", kv_cache_memory_gib=args.kv_gib,
            enable_prefix_caching=False,
        )  # fmt: skip
        for batch in args.batch:
            # The same prompts in both modes.
            gen = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()] * batch
            _generate(llm, prompts, 4)  # warm-up: kernels compiled
            ms, ids = step_ms(llm, prompts, args.tokens, args.repeats)
            tokens_by_mode.setdefault(mode, []).append(ids)
            rows.append(Row(
                name, batch, mode, ms, batch / ms * 1e3,
                launches_per_step(llm, prompts, min(args.tokens, 16)),
                roofline_ms(llm, batch, args.prompt + args.tokens // 2, bandwidth),
            ))  # fmt: skip
            print(f"{name} batch {batch} {mode}: {ms:.2f} ms/step", file=sys.stderr, flush=True)
        del llm
        torch.cuda.empty_cache()
    return rows, tokens_by_mode["eager"] == tokens_by_mode["graphs"]


def markdown(rows: list[Row], same: dict[str, bool], bandwidth: float) -> str:
    lines = [
        "| model | batch | mode | ms / step | tokens/s | launches / step | roofline ms | "
        "of roofline |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        frac = r.roofline_ms / r.ms_per_step
        lines.append(
            f"| {r.model} | {r.batch} | {r.mode} | {r.ms_per_step:.2f} | {r.tokens_per_s:.0f} "
            f"| {r.launches_per_step:.0f} | {r.roofline_ms:.3f} | {frac:.0%} |"
        )
    lines.append(f"\nRead bandwidth (a sum over 1 GiB): {bandwidth / 1e9:.0f} GB/s.")
    lines += [f"- {m}: greedy tokens and their logprobs of eager and graphs "
              f"{'equal' if s else 'DIFFER'}" for m, s in same.items()]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=8.0)
    parser.add_argument("--out", type=Path, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = read_bandwidth(Timer("cuda", repeats=20, warmup=3), "cuda", 1 << 30)
    rows, same = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            model_rows, same[name] = bench_model(name, args, Path(folder), bandwidth)
            rows += model_rows
    table = markdown(rows, same, bandwidth)
    print(table)
    if args.out:
        import triton

        meta = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m bench.decode_step " + " ".join(sys.argv[1:]),
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {**meta, "rows": [asdict(r) for r in rows], "tokens_equal": same}
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
        args.out.with_suffix(".md").write_text(f"# Engine decode step\n\n{header}\n\n{table}\n")
    if not all(same.values()):
        print("eager and graphs decode differently", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
