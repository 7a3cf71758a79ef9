"""Output tokens/s of the engine at 1 and 8 concurrent requests, next to transformers' generate.

    python -m bench.engine_speed [--model smollm2-135m-instruct] [--tokens 128] [--repeats 3]

Both run in this process on the same weights, with the same thread count; medians are quoted.

With ``--dtypes float32 bfloat16`` it compares output tok/s across dtypes instead: one engine
per dtype (KV cache ``auto`` for each), side by side in this process, runs interleaved.

With ``--tensor-parallel-size 1 2`` it compares decode steps (ms/step, tok/s) across rank
counts instead: one engine per count, side by side in this process, runs interleaved; one rank
runs on ``--threads`` torch threads, N ranks on the machine's cores / N each (as the engine
sets them). A model without a tokenizer gets random token-id prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from engine import LLM, SamplingParams
from engine.args import add_cli_args
from engine.worker.tp_workers import threads_per_rank
from models.kv_spec import DTYPES

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
    "List some facts about the Moon.",
    "Describe the water cycle to a child.",
    "What makes a good cup of coffee?",
    "Summarise the history of the printing press.",
    "Give advice to someone learning to cook.",
    "Why is the sky blue?",
]


def bench_engine(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return len(prompts) * tokens / elapsed


def decode_steps(llm: LLM, prompts: list[list[int]], tokens: int) -> list[float]:
    """Seconds of each step once every prompt has its first token (decodes only)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [f"decode-{uuid.uuid4().hex}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    steps = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def compare_tensor_parallel(args: argparse.Namespace) -> int:
    """Decode ms/step and tok/s per rank count, the engines side by side, runs interleaved."""
    sizes = args.tensor_parallel_size
    llms = {
        n: LLM(args.model, device=args.device, tensor_parallel_size=n, max_model_len=1024,
               max_num_seqs=64, kv_cache_memory_gib=0.25, cpu_kernels=args.cpu_kernels)
        for n in sizes
    }  # fmt: skip
    first = llms[sizes[0]]
    g = torch.Generator().manual_seed(0)
    vocab = first.engine.model_config.vocab_size
    prompts = prompts_for(first) or [torch.randint(vocab, (24,), generator=g).tolist()] * 8
    print(
        f"model {first.engine.model_config.name}, device {first.engine.device}, "
        f"{args.tokens} new tokens per request, median decode step of {args.repeats} runs"
    )
    threads = {n: args.threads if n == 1 else threads_per_rank(n) for n in sizes}
    print(
        f"{'concurrent':>10} {'ranks':>6} {'threads/rank':>13} {'ms/step':>9} "
        f"{'decode tok/s':>13} {'vs first':>9}"
    )
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        steps: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit all alike
            for n in sizes:
                torch.set_num_threads(threads[n])
                steps[n] += decode_steps(llms[n], batch, args.tokens)
        base = statistics.median(steps[sizes[0]])
        for n in sizes:
            ms = statistics.median(steps[n])
            print(
                f"{c:>10} {n:>6} {threads[n]:>13} {ms * 1e3:>9.2f} {c / ms:>13.1f} "
                f"{base / ms:>9.2f}"
            )
    for llm in llms.values():
        llm.engine.shutdown()
    return 0


def compare_dtypes(args: argparse.Namespace) -> int:
    """Output tok/s per dtype, the engines side by side, runs interleaved."""
    llms = {
        d: LLM(args.model, device=args.device, dtype=d, max_model_len=1024, max_num_seqs=64,
               cpu_kernels=args.cpu_kernels, repack_weights=args.repack_weights)
        for d in args.dtypes
    }  # fmt: skip
    first = llms[args.dtypes[0]]
    prompts = prompts_for(first)
    print(
        f"model {first.engine.model_config.name}, device {first.engine.device}, "
        f"threads {args.threads}, {args.tokens} new tokens per request, median of {args.repeats}"
    )
    print(f"{'concurrent':>10} {'dtype':>9} {'KV cache':>9} {'tok/s':>8} {'vs first':>9}")
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        runs: dict[str, list[float]] = {d: [] for d in args.dtypes}
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit all alike
            for d, llm in llms.items():
                runs[d].append(bench_engine(llm, batch, args.tokens))
        base = statistics.median(runs[args.dtypes[0]])
        for d, llm in llms.items():
            rate = statistics.median(runs[d])
            kv = llm.engine.runner.config.kv_dtype
            print(f"{c:>10} {d:>9} {kv:>9} {rate:>8.1f} {rate / base:>9.2f}")
    return 0


def prompts_for(llm: LLM) -> list[list[int]]:
    """The chat prompts in the model's template; none without a tokenizer."""
    tok = llm.tokenizer
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS] if tok else []


def bench_transformers(model, prompts: list[list[int]], tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == tokens
    return len(prompts) * tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(
        parser, ("model", "device", "cpu_kernels", "repack_weights"),
        {"model": "smollm2-135m-instruct"}, required=(),
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--tensor-parallel-size", type=int, nargs="+", metavar="N",
        help="compare decode steps at these rank counts instead (no transformers run)",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, metavar="DTYPE",
        help="compare output tok/s across these dtypes instead (no transformers run)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tensor_parallel_size:
        return compare_tensor_parallel(args)
    if args.dtypes:
        return compare_dtypes(args)

    llm = LLM(
        args.model, device=args.device, max_model_len=1024, max_num_seqs=64,
        cpu_kernels=args.cpu_kernels, repack_weights=args.repack_weights,
    )  # fmt: skip
    tok = llm.tokenizer
    prompts = prompts_for(llm)
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            str(llm.engine.model_config.path), dtype=llm.engine.runner.dtype
        ).to(llm.engine.device)
        hf.eval()

    print(
        f"model {llm.engine.model_config.name}, device {llm.engine.device}, "
        f"threads {args.threads}, {args.tokens} new tokens per request, "
        f"median of {args.repeats}"
    )
    print(f"{'concurrent':>10} {'kvserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}")
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
            ours.append(bench_engine(llm, batch, args.tokens))
            if hf is not None:
                theirs.append(bench_transformers(hf, batch, args.tokens, tok.eos_token_ids[0]))
        a = statistics.median(ours)
        b = statistics.median(theirs) if theirs else float("nan")
        print(f"{c:>10} {a:>14.1f} {b:>19.1f} {a / b:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
