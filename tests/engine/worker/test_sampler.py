"""The batched sampler against plain per-row references: processed rows equal exactly, draws
follow the filtered distribution, seeded requests ignore their batch, failures stay per row."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.worker import sampler as sampler_module
from engine.worker.sampler import Sampler, _top_p, logprobs_of

CPU = torch.device("cpu")
EOS = (5,)


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


def _naive_process(logits, p: SamplingParams, prompt, output, eos=EOS) -> torch.Tensor:
    """One row, token by token, in float32 arithmetic."""
    row = logits.clone().numpy()
    f32 = np.float32
    for t, b in p.logit_bias:
        row[t] = row[t] + f32(b)
    if p.repetition_penalty != 1.0:
        rp = f32(p.repetition_penalty)
        for t in set(prompt) | set(output):
            row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
    for t, c in Counter(output).items():
        row[t] = row[t] - (f32(p.frequency_penalty) * f32(c) + f32(p.presence_penalty))
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            row[t] = -np.inf
    return torch.from_numpy(row)


def _naive_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p by a full sort, min-p: probabilities, filtered ones 0."""
    row = (row - row.max()) / torch.tensor(p.temperature)
    if 0 < p.top_k < row.shape[0]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        values, order = probs.sort(descending=True)
        drop = values.cumsum(0) - values > torch.tensor(p.top_p)
        probs = probs.scatter(0, order, values.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < torch.tensor(p.min_p) * probs.max(), 0.0)
    return probs


def _logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.3, top_k=10, top_p=0.95),
        dict(temperature=1.0, min_p=0.05, top_p=0.9),
        dict(temperature=0.9, top_k=3),
    ],
)
@pytest.mark.parametrize("full_sort", [False, True])
def test_draws_follow_the_filtered_distribution(params, full_sort):
    p = SamplingParams(**params, seed=3)
    logits = torch.randn(40, generator=torch.Generator().manual_seed(7)) * 2
    expected = _expected(logits, p)
    sampler = Sampler(0, (), CPU)
    sampler.full_sort = full_sort
    n = 10000
    counts = torch.zeros(40)
    for token, _ in sampler.sample(logits.expand(n, -1), ["r"] * n, [p] * n, [[]] * n, [[]] * n):
        counts[token] += 1
    assert counts[expected == 0].sum() == 0  # never a token the filters removed
    assert (counts / n - expected).abs().max() < 0.015
    if p.top_k == 3:
        assert set(counts.nonzero().flatten().tolist()) == set(logits.topk(3).indices.tolist())
    # Chi-square over the kept tokens: 99.9th percentile of 39 degrees of freedom is 72.
    kept = expected > 0
    chi2 = ((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum()
    assert chi2 < 72


def test_a_mixed_batch_draws_each_row_from_its_own_distribution():
    vocab = 30
    logits = _logits(1, vocab, seed=4)[0]
    kinds = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.6),
        SamplingParams(temperature=2.0, min_p=0.2),
    ]
    n = 4000
    params = [kinds[i % 3] for i in range(3 * n)]
    results = Sampler(1, (), CPU).sample(
        logits.expand(3 * n, -1), [f"r{i}" for i in range(3 * n)], params, [[]] * (3 * n),
        [[]] * (3 * n),
    )  # fmt: skip
    for k, p in enumerate(kinds):
        counts = torch.bincount(torch.tensor([t for t, _ in results[k::3]]), minlength=vocab)
        expected = _expected(logits, p)
        assert counts[expected == 0].sum() == 0
        assert (counts / n - expected).abs().max() < 0.025


@pytest.mark.parametrize("full_sort", [False, True])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(full_sort):
    masses = [0.05, 0.5, 0.99, 0.999999, 0.3]
    logits = torch.randn(len(masses), 20000, generator=torch.Generator().manual_seed(1))
    logits[4] *= 8  # a peaked row: done with the first 64 candidates while the others grow
    probs = torch.softmax(logits, -1)
    values, ids = _top_p(probs, torch.tensor(masses), full_sort)
    for row, mass, vals, row_ids in zip(probs, masses, values, ids):
        full = _expected(row.log(), SamplingParams(temperature=1.0, top_p=mass))
        kept = row_ids[vals > 0]
        assert set(kept.tolist()) == set(full.nonzero().flatten().tolist())
        assert torch.equal(vals[vals > 0], row[kept])  # the nucleus's probabilities, unchanged
        assert torch.equal(vals, vals.sort(descending=True).values)  # best first, then 0s


PROCESSING = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, logit_bias={3: 4.5, 17: -100.0, 40: 0.25}),
    SamplingParams(temperature=0.8, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, repetition_penalty=0.7, frequency_penalty=0.3),
    SamplingParams(temperature=0.8, frequency_penalty=-0.55, presence_penalty=1.1),
    SamplingParams(temperature=0.8, presence_penalty=-2.0),
    SamplingParams(temperature=0.8, min_tokens=4, stop_token_ids=(9, 11)),
    SamplingParams(temperature=0.8, min_tokens=4, stop_token_ids=(9,), ignore_eos=True),
    SamplingParams(temperature=0.8, min_tokens=1),  # its output is already long enough
    SamplingParams(
        temperature=0.3,
        logit_bias={2: 1.5, 9: 3.0},
        repetition_penalty=1.9,
        frequency_penalty=0.7,
        presence_penalty=0.2,
        min_tokens=9,
        stop_token_ids=(2,),
    ),  # fmt: skip
    SamplingParams(temperature=0.8, frequency_penalty=0.5),  # no output yet
]


def _histories(n: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (int(3 + 5 * i),), generator=g).tolist() for i in range(n)]
    outputs = [torch.randint(0, 12, (3,), generator=g).tolist() for _ in range(n)]
    outputs[-1] = []
    return prompts, outputs


def test_processed_rows_equal_the_per_row_reference_exactly():
    vocab = 64
    n = len(PROCESSING)
    logits = _logits(n, vocab)
    logits[:, 0] = 0.0  # a zero logit: the repetition penalty leaves it (multiplies by rp)
    prompts, outputs = _histories(n, vocab)
    sampler = Sampler(0, EOS, CPU)
    x = sampler._process(logits, list(range(n)), PROCESSING, prompts, outputs)
    for i, p in enumerate(PROCESSING):
        expected = _naive_process(logits[i], p, prompts[i], outputs[i])
        assert torch.equal(x[i], expected), p
    # The rows of a subset (in any order) are processed as in the whole batch.
    rows = [7, 2, 9]
    sub = sampler._process(logits, rows, [PROCESSING[i] for i in rows],
                           [prompts[i] for i in rows], [outputs[i] for i in rows])  # fmt: skip
    assert torch.equal(sub, x[rows])


FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.25),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=1.1, top_p=0.95, top_k=20),
    SamplingParams(temperature=0.6, min_p=0.1),
    SamplingParams(temperature=1.4, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=999),  # beyond the vocabulary: off
    SamplingParams(temperature=1.0, top_p=0.999999),
]


@pytest.mark.parametrize("full_sort", [False, True])
def test_filtered_rows_equal_the_per_row_reference_exactly(full_sort):
    vocab = 300
    logits = _logits(len(FILTERS), vocab, seed=5)
    logits[:, 7] = float("-inf")  # banned tokens stay at probability 0
    sampler = Sampler(0, EOS, CPU)
    sampler.full_sort = full_sort
    probs, (rows, values, ids) = sampler._filter(logits, FILTERS)
    # The rows with a top-p are drawn from their nucleus: back to the whole vocabulary.
    probs[rows] = torch.zeros(len(rows), vocab).scatter_add_(1, ids, values)
    for i, p in enumerate(FILTERS):
        expected = _naive_filter(logits[i], p)
        assert torch.equal(probs[i] > 0, expected > 0), p
        assert torch.equal(probs[i], expected), p


def _run(sampler: Sampler, rows: list[tuple[str, SamplingParams]], steps: int, vocab=50):
    """``steps`` steps of the rows (request id, params) on step-dependent logits: each
    request's tokens (or its exception)."""
    outputs = {rid: [] for rid, _ in rows}
    for step in range(steps):
        # The same logits in every row, whatever the batch.
        logits = _logits(1, vocab, seed=100 + step).expand(len(rows), -1).clone()
        results = sampler.sample(
            logits, [r for r, _ in rows], [p for _, p in rows], [[1, 2, 3]] * len(rows),
            [outputs[r][:] for r, _ in rows],
        )  # fmt: skip
        for (rid, _), result in zip(rows, results):
            if isinstance(result, Exception):
                outputs[rid] = result
            else:
                outputs[rid].append(result[0])
    return outputs


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    seeded = ("s", SamplingParams(temperature=1.2, top_p=0.9, seed=42))
    alone = _run(Sampler(0, EOS, CPU), [seeded], 12)["s"]
    others = [
        ("a", SamplingParams(temperature=0.9)),
        ("b", SamplingParams(temperature=0)),
        ("c", SamplingParams(temperature=1.5, top_k=4, seed=7)),
        ("d", SamplingParams(temperature=0.7, repetition_penalty=1.2, logprobs=2)),
        ("e", SamplingParams(temperature=1.0, forced=tuple(range(12)), max_tokens=12)),
    ]
    for batch in ([*others, seeded], [others[0], seeded, others[2]], [seeded, others[1]]):
        assert _run(Sampler(123, EOS, CPU), batch, 12)["s"] == alone
    assert len(set(alone)) > 3  # drawn, not stuck on one token
    other_seed = ("s", SamplingParams(temperature=1.2, top_p=0.9, seed=43))
    assert _run(Sampler(0, EOS, CPU), [other_seed], 12)["s"] != alone


def test_a_batch_drawn_a_few_rows_at_a_time_draws_the_same_tokens(monkeypatch):
    vocab, n = 60, 13
    kinds = FILTERS + [SamplingParams(temperature=0.5, seed=4, logprobs=1)]
    params = [kinds[i % len(kinds)] for i in range(n)]
    logits = _logits(n, vocab, seed=11)

    def run():
        args = (logits.clone(), [f"r{i}" for i in range(n)], params, [[1]] * n, [[2]] * n)
        return Sampler(7, EOS, CPU).sample(*args)

    whole = run()
    monkeypatch.setattr(sampler_module, "CPU_CHUNK_BYTES", 3 * vocab * 4)  # 3 rows a chunk
    assert run() == whole


def test_a_mixed_batch_matches_the_per_row_reference():
    vocab = 80
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=5, seed=1, logprobs=0),
        SamplingParams(forced=(7, 8, 9, 10), max_tokens=4, logprobs=2, frequency_penalty=0.4),
        SamplingParams(temperature=1.0, top_p=0.5, presence_penalty=1.0, logit_bias={4: 9.0}),
        SamplingParams(temperature=0, min_tokens=8, stop_token_ids=(0,)),
        SamplingParams(temperature=1.2, min_p=0.3, logprobs=5),
    ]
    n = len(params)
    logits = _logits(n, vocab, seed=9)
    prompts, outputs = _histories(n, vocab)
    sampler = Sampler(0, EOS, CPU)
    results = sampler.sample(logits.clone(), [f"r{i}" for i in range(n)], params, prompts,
                             [o[:] for o in outputs])  # fmt: skip
    for i, p in enumerate(params):
        token, record = results[i]
        row = _naive_process(logits[i], p, prompts[i], outputs[i])
        if p.forced:
            assert token == p.forced[len(outputs[i])]
        elif p.greedy:
            assert token == int(row.argmax())
        else:
            assert _naive_filter(row, p)[token] > 0
        if p.logprobs is None:
            assert record is None
            continue
        lp = torch.log_softmax(row, -1)
        assert record.token_id == token
        assert record.logprob == pytest.approx(float(lp[token]), abs=1e-6)
        assert record.rank == int((lp > lp[token]).sum()) + 1
        values, ids = lp.topk(p.logprobs)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [v for _, v in record.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_the_tokens_and_logprobs_come_back_in_one_transfer_each(monkeypatch):
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, logprobs=2),
        SamplingParams(forced=(7, 8, 9), max_tokens=3, logprobs=0, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5),
    ]
    sampler = Sampler(0, EOS, CPU)
    sampler.full_sort = True  # as on an accelerator
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    outs = [[1, 2]] * len(params)
    results = sampler.sample(_logits(4, 100), list("abcd"), params, [[3]] * 4, outs)
    assert all(not isinstance(r, Exception) for r in results)
    assert reads == ["tolist", "tolist"]


def test_all_greedy_rows_take_the_argmax():
    logits = _logits(6, 70, seed=3)
    params = [SamplingParams(temperature=0)] * 6
    results = Sampler(0, EOS, CPU).sample(logits, list("abcdef"), params, [[1]] * 6, [[]] * 6)
    assert results == [(t, None) for t in logits.argmax(-1).tolist()]


def test_logprobs_of_scores_the_given_tokens():
    logits = _logits(3, 50, seed=8)
    records = logprobs_of(logits, [4, 0, 49], 3)
    lp = torch.log_softmax(logits, -1)
    for row, t, r in zip(lp, [4, 0, 49], records):
        assert r.token_id == t and r.logprob == pytest.approx(float(row[t]), abs=1e-6)
        assert r.rank == int((row > row[t]).sum()) + 1
        assert [i for i, _ in r.top] == row.topk(3).indices.tolist()
        assert all(isinstance(i, int) and isinstance(v, float) for i, v in r.top)
    assert [r.top for r in logprobs_of(logits, [1, 2, 3], 0)] == [[], [], []]


GOOD = [
    ("g", SamplingParams(temperature=0, repetition_penalty=1.1)),
    ("s", SamplingParams(temperature=1.0, seed=5, top_k=10, logprobs=1)),
    ("f", SamplingParams(forced=(3, 4, 5, 6), max_tokens=4, logprobs=0)),
]


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(temperature=0.5, logit_bias={10_000: 1.0}),
        SamplingParams(temperature=0, min_tokens=5, stop_token_ids=(50,)),
        SamplingParams(forced=(1, 2), max_tokens=2),  # runs out of forced tokens at step 3
        SamplingParams(forced=(1, 50, 2, 3), max_tokens=4),
        SamplingParams(temperature=0.5, seed=9, extra={"bad_prompt": True}),
    ],
)
def test_a_failing_row_fails_alone(bad):
    expected = _run(Sampler(0, EOS, CPU), GOOD, 4)
    prompt = [1, 2, 3]
    if bad.extra.get("bad_prompt"):  # an id past the vocabulary, met by the repetition penalty
        bad = SamplingParams(temperature=0.5, seed=9, repetition_penalty=1.2)
        prompt = [1, 50]
    sampler = Sampler(0, EOS, CPU)
    rows = [GOOD[0], ("x", bad), *GOOD[1:]]
    outputs = {rid: [] for rid, _ in rows}
    for step in range(4):
        logits = _logits(1, 50, seed=100 + step).expand(len(rows), -1).clone()
        results = sampler.sample(
            logits, [r for r, _ in rows], [p for _, p in rows],
            [prompt if r == "x" else [1, 2, 3] for r, _ in rows],
            [[] if isinstance(outputs[r], Exception) else outputs[r][:] for r, _ in rows],
        )  # fmt: skip
        for (rid, _), result in zip(rows, results):
            if isinstance(result, Exception):
                assert rid == "x"
                outputs[rid] = result
            elif not isinstance(outputs[rid], Exception):
                outputs[rid].append(result[0])
    assert isinstance(outputs["x"], Exception)
    assert {r: outputs[r] for r, _ in GOOD} == expected


def test_a_batched_failure_falls_back_to_rows(monkeypatch):
    expected = _run(Sampler(0, EOS, CPU), GOOD, 4)
    original = Sampler._process

    def failing(self, logits, rows, params, prompts, outputs):
        if any(p.extra.get("poison") for p in params):
            raise RuntimeError("poisoned row")
        return original(self, logits, rows, params, prompts, outputs)

    monkeypatch.setattr(Sampler, "_process", failing)
    poisoned = ("x", SamplingParams(temperature=0.7, seed=3, extra={"poison": True}))
    sampler = Sampler(0, EOS, CPU)
    rows = [GOOD[0], poisoned, *GOOD[1:]]
    results = sampler.sample(_logits(1, 50, seed=100).expand(4, -1).clone(),
                             [r for r, _ in rows], [p for _, p in rows], [[1, 2, 3]] * 4,
                             [[]] * 4)  # fmt: skip
    assert isinstance(results[1], RuntimeError) and "poisoned" in str(results[1])
    good = [results[0], *results[2:]]
    assert [t for t, _ in good] == [expected[r][0] for r, _ in GOOD]
