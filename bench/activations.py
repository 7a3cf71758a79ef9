"""What rounding activations to int8 costs a block-format model's predictions, by step size.

    python -m bench.activations [--model qwen2.5-coder-0.5b-instruct] [--text alice]
        [--tokens 2048] [--chunks 1 4 512] [--out PREFIX]

The C++ kernels multiply block-format weights by activations rounded to int8 digits
(``kernels/csrc/cpu/qlinear.h``). The text's first ``--tokens`` tokens are read in one context,
teacher forced, once by the fp32-activation reference (``cpu_kernels=False``: the weights
dequantized by gguf-py and multiplied in float32) and once through the kernels for each
``--chunks`` value, the rows each step multiplies (``max_num_batched_tokens``: 1 takes the
one-row products, up to 5 the few-row ones, more the register tiles). Per chunk: perplexity,
mean and 99th-percentile KL divergence from the reference and top-1 agreement with it, over
every predicted token, and whether they pass the gate a rounding must pass to be served. Both
runs keep K/V in float32. Exits 1 when a chunk fails the gate.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench import quality
from bench.cpu import cpu_model
from engine.args import EngineArgs
from kernels import cpu
from models.fetch import resolve_model
from models.tokenizer import Tokenizer

# The gate a chunk size's rounding must pass to be served.
MAX_KLD, MIN_TOP1 = 1e-3, 0.995


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    chunk: int
    rows: int
    perplexity: float
    kld_mean: float
    kld_p99: float
    top1: float

    @property
    def passes(self) -> bool:
        return self.kld_mean <= MAX_KLD and self.top1 >= MIN_TOP1


def chunk_costs(
    model: str, tokens: list[int], chunks: list[int]
) -> tuple[float, dict[int, ChunkCost]]:
    """The reference's perplexity, and each chunk size's costs against it."""
    base = EngineArgs(model=model, max_model_len=len(tokens) + 16, kv_cache_dtype="float32",
                      cpu_kernels=False)  # fmt: skip
    reference = quality.reference_run(base, tokens)
    ppl = quality.full_context_cost(base, tokens, reference)[1][1]
    costs = {}
    for chunk in chunks:
        args = dataclasses.replace(
            base, cpu_kernels=True, max_num_batched_tokens=chunk, enable_prefix_caching=False
        )
        costs[chunk] = ChunkCost(chunk, *quality.full_context_cost(args, tokens, reference)[1])
        print(costs[chunk], flush=True)
    return ppl, costs


def report(args, ppl: float, costs: dict[int, ChunkCost]) -> str:
    lines = [
        f"# Activation rounding on {args.model}, {datetime.now(timezone.utc):%Y-%m-%d}",
        "",
        f"Box: {cpu_model()}, build `{cpu.chosen_isa()}`. Text `{args.text}`, first "
        f"{args.tokens} tokens in one context, teacher forced; reference: fp32 activations "
        f"(perplexity {ppl:.4f}). Gate: mean KLD <= {MAX_KLD:g}, top-1 >= {MIN_TOP1:.1%}.",
        "",
        f"Command: `python -m bench.activations {' '.join(args.argv)}`",
        "",
        "| rows per step | rows scored | perplexity | mean KLD | p99 KLD | top-1 | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in costs.values():
        lines.append(
            f"| {c.chunk} | {c.rows} | {c.perplexity:.4f} | "
            f"{c.kld_mean:.2e} | {c.kld_p99:.2e} | {c.top1:.2%} | "
            f"{'pass' if c.passes else 'FAIL'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.activations",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--text", default="alice")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 4, 512])
    p.add_argument("--out", help="write PREFIX.md")
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    why = cpu.load()
    if why is not None:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")
    path = resolve_model(args.model)
    ids = Tokenizer.from_dir(path).encode(quality.load_text(args.text))[: args.tokens]
    ppl, costs = chunk_costs(str(path), ids, args.chunks)
    text = report(args, ppl, costs)
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
    return 0 if all(c.passes for c in costs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
