"""Output tokens/s of the engine at 1 and 8 concurrent requests, next to transformers' generate.

    python -m bench.engine_speed [--model smollm2-135m-instruct] [--tokens 128] [--repeats 3]

Both run in this process on the same weights, with the same thread count; medians are quoted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.args import add_cli_args

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
    add_cli_args(parser, ("model", "device"), {"model": "smollm2-135m-instruct"}, required=())
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, device=args.device, max_model_len=1024, max_num_seqs=64)
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
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
