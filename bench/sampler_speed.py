"""The sampler's time per step, mixed sampling parameters against an all-greedy batch.

    python -m bench.sampler_speed [--batch 1 8 64] [--vocab 49152] [--device cpu] [--threads N]

Per batch size: the median time of one ``Sampler.sample`` call on random logits (the tokens
back on the host included), for an all-greedy batch (the argmax fast path) and for a batch
cycling through top-p, top-k, min-p, penalties, logit_bias, seeds, logprobs and greedy
(prompts of 512 tokens, 64 output tokens; a batch of 1 is the top-p row). Fresh logits each
step, as the model's are.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler

MIXED = [
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=0.7, min_p=0.05, seed=1),
    SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.2, seed=2),
    SamplingParams(temperature=0, logprobs=5),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, presence_penalty=0.3),
    SamplingParams(temperature=1.0, logit_bias={7: 5.0, 11: -100.0}),
    SamplingParams(temperature=0),
]
GREEDY = [SamplingParams(temperature=0)]


def step_ms(sampler: Sampler, batch: int, vocab: int, kinds, repeats: int, device) -> float:
    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(device)
    params = [kinds[i % len(kinds)] for i in range(batch)]
    prompts = [torch.randint(0, vocab, (512,), generator=g).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    times = []
    for i in range(repeats + 3):  # the first three warm up
        fresh = logits.clone()  # as the model's, new each step
        start = time.perf_counter()
        sampler.sample(fresh, ids, params, prompts, outputs)  # ends with the tokens on the host
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch threads on a CPU (default: torch's)")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = Sampler(0, (2,), device)
    print(f"sampler ms/step, vocab {args.vocab}, {device}, {torch.get_num_threads()} threads")
    print(f"{'batch':>5}  {'all greedy':>10}  {'mixed':>8}  {'mixed/row':>9}")
    for batch in args.batch:
        greedy = step_ms(sampler, batch, args.vocab, GREEDY, args.repeats, device)
        mixed = step_ms(sampler, batch, args.vocab, MIXED, args.repeats, device)
        print(f"{batch:>5}  {greedy:>10.3f}  {mixed:>8.3f}  {mixed / batch:>9.3f}")


if __name__ == "__main__":
    main()
