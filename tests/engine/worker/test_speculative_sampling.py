"""Speculative verification in the sampler (``Sampler.verify``), without a model.

Greedy: a draft stands while it is the target's own choice, the first that is not is replaced
by that choice, and a run of accepted drafts ends with a bonus token. Sampled: the rule must
leave every token distributed exactly as the target's filtered distribution, whatever was
drafted; that is checked empirically (chi-square over many independent verifications). Each row
is processed as if the drafts before it were already output (penalties, min_tokens), the
logprob records are those plain sampling gives for the same rows, and a constrained request's
draft rows are masked by its grammar as advanced through the drafts before them. The sampler's
generators are seeded: the statistical checks draw the same numbers on every run.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from engine.core.sampling_params import Constraint, SamplingParams
from engine.worker.sampler import Sampler, logprobs_of

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
V = 8
# 99.9th percentiles of the chi-square distribution by degrees of freedom (no scipy here).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def sampler(seed: int = 0) -> Sampler:
    return Sampler(seed, eos_token_ids=(), device=CPU)


def verify_one(s: Sampler, rows: torch.Tensor, p: SamplingParams, drafts, output=(), rid="r"):
    """One request's verification: its tokens (and records)."""
    (result,) = s.verify(rows.clone(), [rid], [p], [[1, 2]], [list(output)], [list(drafts)])
    assert not isinstance(result, Exception), result
    return result


def tokens_of(result) -> list[int]:
    return [t for t, _ in result]


# -- greedy -------------------------------------------------------------------------------------


def greedy_rows(best: list[int], vocab: int = 16, seed: int = 0) -> torch.Tensor:
    """Random rows whose argmax is ``best[i]`` (by a clear margin)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(best), vocab, generator=g)
    for i, b in enumerate(best):
        rows[i, b] = rows[i].max() + 1.0
    return rows


@pytest.mark.parametrize("matching", [0, 1, 2, 3])
def test_greedy_keeps_the_drafts_up_to_the_first_mismatch_then_the_targets_choice(matching):
    best = [4, 9, 2, 11]  # the target's argmax at each of the 4 rows
    drafts = best[:3]
    if matching < 3:
        drafts = drafts[:matching] + [(best[matching] + 1) % 16] + drafts[matching + 1 :]
    rows = greedy_rows(best)
    got = tokens_of(verify_one(sampler(), rows, SamplingParams(temperature=0), drafts))
    assert got == drafts[:matching] + [best[matching]]


def test_greedy_with_every_draft_accepted_adds_the_last_rows_bonus_token():
    best = [3, 3, 7, 1, 0, 12]
    rows = greedy_rows(best, seed=1)
    got = tokens_of(verify_one(sampler(), rows, SamplingParams(temperature=0), best[:5]))
    assert got == best  # k + 1 tokens


def test_a_batch_verifies_each_request_on_its_own_rows():
    a_best, b_best, c_best = [1, 2, 3], [5], [6, 7]
    rows = torch.cat([greedy_rows(a_best, seed=2), greedy_rows(b_best, seed=3),
                      greedy_rows(c_best, seed=4)])  # fmt: skip
    p = SamplingParams(temperature=0)
    out = sampler().verify(rows, ["a", "b", "c"], [p] * 3, [[1]] * 3, [[]] * 3, [[1, 9], [], [6]])
    assert [tokens_of(r) for r in out] == [[1, 2], [5], [6, 7]]


def test_without_drafts_verify_is_plain_sampling():
    rows = greedy_rows([3, 5], seed=5)
    p = SamplingParams(temperature=0, logprobs=2)
    s = sampler()
    got = s.verify(rows, ["a", "b"], [p, p], [[1], [1]], [[], []], [[], []])
    assert got == [[r] for r in s.sample(rows, ["a", "b"], [p, p], [[1], [1]], [[], []])]


# -- the rejection rule's distribution ---------------------------------------------------------

P0 = torch.tensor([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
P1 = torch.tensor([0.03, 0.38, 0.05, 0.11, 0.21, 0.06, 0.09, 0.07])
P2 = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.30])


def reference(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target's distribution for a row of ``probs`` (logits log(probs)): temperature, then
    top-k, then top-p by a full sort, normalized."""
    x = probs.log() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    q = torch.softmax(x.double(), dim=-1)
    if p.top_p < 1.0:
        values, order = q.sort(descending=True)
        drop = values.cumsum(0) - values > p.top_p
        q = q.scatter(0, order, values.masked_fill(drop, 0.0))
    return q / q.sum()


def check_distribution(counts: Counter, expected: torch.Tensor, what: str) -> None:
    """``counts`` of draws follow ``expected``: nothing outside its support, a chi-square below
    its 99.9th percentile, and no frequency over 4.5 sigma off."""
    n = sum(counts.values())
    assert n >= 1000, f"{what}: too few draws ({n}) to test"
    support = [t for t in range(V) if expected[t] > 0]
    outside = {t: c for t, c in counts.items() if expected[t] == 0}
    assert not outside, f"{what}: drew tokens the target gives no mass: {outside}"
    chi2 = sum(
        (counts[t] - n * expected[t].item()) ** 2 / (n * expected[t].item()) for t in support
    )
    assert chi2 < CHI2_999[len(support) - 1], f"{what}: chi2 {chi2:.1f} over {n} draws"
    for t in support:
        q = expected[t].item()
        sigma = math.sqrt(q * (1 - q) / n)
        assert abs(counts[t] / n - q) < 4.5 * sigma, f"{what}: token {t}"


def many_verifications(p: SamplingParams, drafts: list[int], n: int, seed: int = 0):
    """``n`` independent verifications of the rows log(P0), log(P1), log(P2)[: k + 1] against
    ``drafts``, each from the shared generator, all in one batch."""
    rows = torch.stack([P0, P1, P2])[: len(drafts) + 1].log()
    out = sampler(seed).verify(
        rows.repeat(n, 1), [f"r{i}" for i in range(n)], [p] * n, [[1]] * n, [[]] * n,
        [drafts] * n,
    )  # fmt: skip
    return [tokens_of(r) for r in out]


@pytest.mark.parametrize(
    "params, drafts",
    [
        # temperature 1: the target is P0 itself; a likely first draft, then an unlikely one
        (dict(temperature=1.0), [0, 7]),
        # an unlikely first draft: mostly rejected, its mass comes from the residual draw
        (dict(temperature=1.0), [7, 1]),
        # temperature: the target is P0 sharpened
        (dict(temperature=0.7), [1, 4]),
        # top-k 4 removes token 6 (p 0.04): a draft the target cannot produce
        (dict(temperature=1.0, top_k=4), [6, 1]),
        # top-p 0.72 keeps tokens 0..3 of P0 (0.30 + 0.22 + 0.15 = 0.67 < 0.72); token 5 is out
        (dict(temperature=1.0, top_p=0.72), [5, 4]),
        # both: P0 keeps tokens 0 and 1 only; P1 keeps 1 and 4, so the second draft is out
        (dict(temperature=1.0, top_k=5, top_p=0.55), [0, 0]),
    ],
)
def test_sampled_tokens_follow_the_target_distribution_whatever_was_drafted(params, drafts):
    p = SamplingParams(**params)
    n = 20000
    results = many_verifications(p, drafts, n)
    assert all(1 <= len(r) <= len(drafts) + 1 for r in results)
    assert all(r[:-1] == drafts[: len(r) - 1] for r in results), "accepted must be the drafts"
    target0, target1 = reference(P0, p), reference(P1, p)
    check_distribution(Counter(r[0] for r in results), target0, "first token")
    # The first draft is accepted about as often as the target would pick it.
    accepted0 = sum(len(r) > 1 for r in results) / n
    q = target0[drafts[0]].item()
    assert abs(accepted0 - q) < 4.5 * math.sqrt(max(q * (1 - q), 1e-12) / n) + 1e-9
    if q > 0.1:  # given the first was accepted, the second follows row 1's distribution
        second = Counter(r[1] for r in results if len(r) > 1)
        check_distribution(second, target1, "second token")


def test_after_every_draft_is_accepted_the_bonus_follows_the_last_row():
    # Drafts the target likes; the third token (the bonus, drawn at row 2) must follow P2.
    p = SamplingParams(temperature=1.0)
    results = many_verifications(p, [0, 1], 20000, seed=1)
    bonus = Counter(r[2] for r in results if len(r) == 3)
    check_distribution(bonus, reference(P2, p), "bonus token")


def test_a_draft_with_all_the_mass_is_always_accepted_and_one_without_never():
    certain = torch.full((2, V), -30.0)
    certain[0, 3] = 10.0
    certain[1, 5] = 10.0
    p = SamplingParams(temperature=1.0, top_k=1)
    s = sampler()
    assert all(tokens_of(verify_one(s, certain, p, [3])) == [3, 5] for _ in range(50))
    # a draft of a token top_k removed: rejected every time, the target's own token instead
    assert all(tokens_of(verify_one(s, certain, p, [4])) == [3] for _ in range(50))


# -- seeds ---------------------------------------------------------------------------------------


def test_a_seeded_request_verifies_the_same_way_in_any_sampler_and_any_batch():
    rows = torch.stack([P0, P1, P2]).log()
    p = SamplingParams(temperature=0.9, seed=1234)
    drafts = [1, 4]
    runs = []
    for global_seed in (0, 7):
        s = sampler(global_seed)
        runs.append([tokens_of(verify_one(s, rows, p, drafts, rid="x")) for _ in range(40)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1, "the seeded generator should advance"
    # In a batch beside unseeded requests that draw from the shared generator first.
    s = sampler(3)
    other = SamplingParams(temperature=1.0)
    batched = []
    for _ in range(40):
        out = s.verify(
            torch.cat([rows, rows]), ["o", "x"], [other, p], [[1], [1]], [[], []], [[0, 1], drafts]
        )
        batched.append(tokens_of(out[1]))
    assert batched == runs[0]


def test_a_different_seed_gives_different_verifications():
    rows = torch.stack([P0, P1, P2]).log()
    runs = []
    for seed in (1, 2):
        s, p = sampler(), SamplingParams(temperature=1.0, seed=seed)
        runs.append([tokens_of(verify_one(s, rows, p, [1, 4], rid="x")) for _ in range(40)])
    assert runs[0] != runs[1]


# -- processing each row after the drafts before it ---------------------------------------------


def sample_row_alone(s: Sampler, row: torch.Tensor, p: SamplingParams, output: list[int]):
    (result,) = s.sample(row[None].clone(), ["alone"], [p], [[1, 2]], [output])
    return result


def test_a_frequency_penalty_counts_the_drafts_before_each_row():
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    rows = torch.zeros(4, 16)
    rows[0, 3] = 5.0  # argmax 3
    rows[1, 3], rows[1, 7] = 5.0, 4.6  # 3 was drafted once before: 4.0 < 4.6, so 7
    rows[2, 3], rows[2, 7] = 5.0, 4.9  # 3 and 7 once each: 4.0 > 3.9, so 3
    rows[3, 3], rows[3, 7], rows[3, 9] = 5.5, 4.0, 3.8  # 3 twice, 7 once: 3.5, 3.0, 3.8: 9
    drafts = [3, 7, 3]
    got = tokens_of(verify_one(sampler(), rows, p, drafts, output=[]))
    assert got == [3, 7, 3, 9]
    # each row alone, with the drafts before it as output, chooses the same
    s = sampler()
    alone = [sample_row_alone(s, rows[t], p, drafts[:t])[0] for t in range(4)]
    assert alone == got
    # without the drafts counted, row 1 would take 3 (the test can tell the difference)
    assert sample_row_alone(s, rows[1], p, [])[0] == 3


def reference_greedy_verify(s, rows, p, output, drafts) -> list:
    """Verification by plain sampling, one row at a time with the drafts before it as output."""
    got = []
    for t in range(len(drafts) + 1):
        token, record = sample_row_alone(s, rows[t], p, output + drafts[:t])
        got.append((token, record))
        if t == len(drafts) or token != drafts[t]:
            break
    return got


def assert_same_records(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.token_id == b.token_id and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        dict(logprobs=3),
        dict(frequency_penalty=0.8, logprobs=2),
        dict(presence_penalty=1.5, repetition_penalty=1.3, logprobs=0),
        dict(logit_bias=((2, 1.0),), frequency_penalty=-0.5),
        dict(min_tokens=4, stop_token_ids=(5,), logprobs=1),
    ],
)
def test_greedy_verification_equals_sampling_each_row_after_the_drafts_before_it(params):
    p = SamplingParams(temperature=0, **params)
    rng = random.Random(0)
    s = sampler()
    lengths = Counter()
    for case in range(60):
        k = rng.randint(1, 5)
        rows = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(case))
        output = [rng.randrange(V) for _ in range(rng.randint(0, 3))]
        # Drafts: mostly the reference's own choices (so runs get long), sometimes not.
        drafts: list[int] = []
        for t in range(k):
            own = sample_row_alone(s, rows[t], p, output + drafts)[0]
            drafts.append(own if rng.random() < 0.8 else rng.randrange(V))
        got = verify_one(s, rows, p, drafts, output=output)
        want = reference_greedy_verify(s, rows, p, output, drafts)
        assert_same_records(got, want)
        lengths[len(got)] += 1
    assert len(lengths) >= 3  # short and long runs both exercised


def test_sampled_logprob_records_are_those_of_the_unscaled_rows():
    rows = torch.stack([P0, P1, P2]).log() * 2
    p = SamplingParams(temperature=0.6, logprobs=3, seed=5)
    s = sampler()
    for _ in range(20):
        got = verify_one(s, rows, p, [0, 1])
        tokens = tokens_of(got)
        want = logprobs_of(rows[: len(tokens)], tokens, 3)
        assert_same_records(got, list(zip(tokens, want)))


# -- structured output: a mask per draft row ------------------------------------------------------

SMOL_VOCAB = 49152
OBJECT = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    from engine.worker.structured import Grammars

    return Grammars(smollm2_dir / "tokenizer.json", SMOL_VOCAB, (0,))


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:SMOL_VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_each_draft_row_gets_the_mask_after_the_drafts_before_it(grammars):
    import llguidance.numpy

    c = Constraint("json", OBJECT)
    tokens = grammars.tokenizer.tokenize_str('{"a": 12}')
    drafts = tokens[:4]
    masks = grammars.fill_async([("x", c)], [drafts]).result()
    assert masks.shape[0] == len(drafts) + 1
    reference = grammars.matcher("reference", c)
    for t in range(len(drafts) + 1):
        row = llguidance.numpy.allocate_token_bitmask(1, SMOL_VOCAB)
        llguidance.numpy.fill_next_token_bitmask(reference, row, 0)
        assert allowed(masks[t]) == allowed(row[0]), t
        if t < len(drafts):
            assert drafts[t] in allowed(masks[t])
            assert reference.consume_token(drafts[t])
    # The request's matcher is where it was: its next mask is row 0 again.
    again = grammars.fill_async([("x", c)]).result()
    assert allowed(again[0]) == allowed(masks[0])


def test_greedy_verification_rejects_a_draft_the_constraint_forbids(grammars):
    c = Constraint("json", OBJECT)
    tokens = grammars.tokenizer.tokenize_str('{"a": 12}')
    s = Sampler(0, (), CPU, grammars)
    p = SamplingParams(temperature=0, structured=c)
    # The model strongly prefers each draft; the second draft breaks the JSON.
    drafts = [tokens[0], tokens[-1], tokens[2]]
    logits = torch.randn(4, SMOL_VOCAB, generator=torch.Generator().manual_seed(0))
    for t, d in enumerate(drafts):
        logits[t, d] = 50.0
    masks = s.start_masks(["x"], [p], [drafts])
    (got,) = s.verify(logits, ["x"], [p], [[1]], [[]], [drafts], masks)
    assert not isinstance(got, Exception), got
    got = tokens_of(got)
    assert got[0] == tokens[0] and len(got) == 2 and got[1] != tokens[-1]
    # The target's token at the rejected row is one the constraint allows there.
    m = grammars.matcher("check", c)
    assert m.consume_token(got[0]) and m.consume_token(got[1])
    # And the request's matcher advanced by exactly the returned tokens.
    after = grammars.fill_async([("x", c)]).result()
    fresh = grammars.fill_async([("check", c)]).result()
    assert allowed(after[0]) == allowed(fresh[0])


def test_constrained_requests_with_and_without_drafts_fill_their_masks_together(grammars):
    c = Constraint("json", OBJECT)
    tokens = grammars.tokenizer.tokenize_str('{"a": 12}')
    masks = grammars.fill_async([("p", c), ("q", c)], [tokens[:2], []]).result()
    assert masks.shape[0] == 4
    alone = grammars.fill_async([("q", c)]).result()
    assert allowed(masks[3]) == allowed(alone[0])
