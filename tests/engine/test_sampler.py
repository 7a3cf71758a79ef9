"""The sampler's draws against the distribution a plain full-sort implementation defines."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, _top_p
from engine.sampling_params import SamplingParams


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p (sorting the whole vocabulary), min-p: the target distribution."""
    row = logits / p.temperature
    if 0 < p.top_k < row.shape[0]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        values, order = probs.sort(descending=True)
        drop = values.cumsum(0) - values > p.top_p
        probs = probs.scatter(0, order, values.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.3, top_k=10, top_p=0.95),
        dict(temperature=1.0, min_p=0.05, top_p=0.9),
    ],
)
def test_draws_follow_the_filtered_distribution(params):
    p = SamplingParams(**params, seed=3)
    logits = torch.randn(40, generator=torch.Generator().manual_seed(7)) * 2
    expected = _expected(logits, p)
    sampler = Sampler(0, (), torch.device("cpu"))
    n = 10000
    counts = torch.zeros(40)
    for token, _ in sampler.sample(logits.expand(n, -1), ["r"] * n, [p] * n, [[]] * n, [[]] * n):
        counts[token] += 1
    assert counts[expected == 0].sum() == 0  # never a token the filters removed
    assert (counts / n - expected).abs().max() < 0.015


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.99, 0.999999])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(top_p):
    probs = torch.softmax(torch.randn(20000, generator=torch.Generator().manual_seed(1)), -1)
    values, ids = _top_p(probs, top_p)
    full = _expected(probs.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert set(ids.tolist()) == set(full.nonzero().flatten().tolist())
    torch.testing.assert_close(values / values.sum(), full[ids])
