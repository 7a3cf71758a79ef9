"""Perplexity under a context policy: the teacher-forced scores against plain transformers
forwards over the context each policy leaves visible, scoring against serving; the KL
divergence and top-1 agreement of each row against the float32-KV full-context run, against
the API's whole distributions; and the ``kvserve tune --objective quality`` report."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench import quality, tune
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.context_overflow import IMPORTANCE_POLICIES, ContextOverflow
from tests.helpers import random_prompt, save_tiny_deepseek_v3, save_tiny_gemma3, save_tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
LIMIT = 64
BLOCK = 8
CHUNK = 16
# The API returns 20 logprobs at most: over a vocabulary of 20 they are the whole distribution.
SMALL_VOCAB = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path, vocab_size=VOCAB, max_position_embeddings=512)
    return path, model


def base_args(path) -> EngineArgs:
    return EngineArgs(
        model=str(path), dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=BLOCK
    )


def plain_logprobs(model, seq: list[int]) -> torch.Tensor:
    """Row j: the logprob transformers gives seq[j + 1] after seq[: j + 1], from position 0."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_truncate_scores_equal_a_plain_forward_over_each_truncated_context(tiny):
    path, model = tiny
    tokens = random_prompt(4 * LIMIT, VOCAB, seed=1)
    keep = 4
    policies = [
        quality.Policy("full", None),
        quality.Policy("truncate", ContextOverflow("truncate", keep)),
    ]
    full, truncated = quality.score(base_args(path), tokens, policies, LIMIT, CHUNK)
    lp = torch.tensor(truncated.logprobs)
    assert len(lp) == len(tokens) - 1
    # Everything fits before the first overflow: the same as the whole text in context.
    reference = plain_logprobs(model, tokens)
    torch.testing.assert_close(torch.tensor(full.logprobs), reference, atol=2e-4, rtol=0)
    torch.testing.assert_close(lp[: LIMIT - 1], reference[: LIMIT - 1], atol=2e-4, rtol=0)
    # Each later chunk: the first n_keep tokens, the latest that leave room for the chunk.
    for start in range(LIMIT, len(tokens), CHUNK):
        room = LIMIT - CHUNK
        visible = tokens[:keep] + tokens[start - (room - keep) : start]
        chunk = tokens[start : start + CHUNK]
        expected = plain_logprobs(model, visible + chunk)[len(visible) - 1 :]
        got = lp[start - 1 : start - 1 + len(chunk)]
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    assert truncated.ppl_after > full.ppl_after * 0.5  # the figures are perplexities, not NLLs


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("one-layer-llama")
    model = save_tiny_llama(
        path, vocab_size=VOCAB, max_position_embeddings=512, num_hidden_layers=1
    )
    return path, model


def test_shift_scores_equal_a_plain_forward_right_after_the_shift(one_layer):
    """One layer, so a cached key and value depend only on their token and position: after a
    shift the cache is exactly that of the visible tokens at their new positions. (In deeper
    layers the kept tokens' keys and values still carry what they attended to before the
    shift; that difference is what a shift costs, and what the scores measure.)"""
    path, model = one_layer
    tokens = random_prompt(3 * LIMIT, VOCAB, seed=2)
    keep, discard = 8, 32
    policy = quality.Policy("shift", ContextOverflow("shift", keep, discard))
    (shifted,) = quality.score(base_args(path), tokens, [policy], LIMIT, CHUNK)
    lp = torch.tensor(shifted.logprobs)
    # When token LIMIT - 1 fills the context, tokens keep..keep+discard leave; the tokens
    # after it are predicted from what is left, with the keys re-rotated, until the next one.
    visible = tokens[:keep] + tokens[keep + discard : LIMIT + discard]
    expected = plain_logprobs(model, visible)[LIMIT - discard - 1 :]
    got = lp[LIMIT - 1 : LIMIT - 1 + discard]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    torch.testing.assert_close(
        lp[: LIMIT - 1], plain_logprobs(model, tokens[:LIMIT]), atol=2e-4, rtol=0
    )


@pytest.mark.parametrize(
    "choice",
    [
        ContextOverflow("shift", 8),
        ContextOverflow("sink", 0),
        ContextOverflow("snapkv", kv_budget=24, window=8),
        ContextOverflow("h2o", kv_budget=32, window=8),
        ContextOverflow("knorm"),
    ],
    ids=["shift", "sink", "snapkv-budget", "h2o-budget", "knorm-full"],
)
def test_scoring_decides_as_serving_does(tiny, choice):
    """Forcing the tokens a served request generated repeats its every decision and score:
    its shifts, or its evictions under an importance policy (with a budget or when the context
    fills)."""
    path, _ = tiny
    prompt = random_prompt(LIMIT - CHUNK, VOCAB, seed=3)
    args = dataclasses.replace(base_args(path), kv_scores=True)
    served_llm = LLM(**dataclasses.asdict(dataclasses.replace(args, max_model_len=LIMIT,
                                                              num_kv_blocks=32)))  # fmt: skip
    serve = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True, logprobs=0,
                           overflow=choice)  # fmt: skip
    (served,) = served_llm.generate([prompt], serve)
    generated = served.outputs[0].token_ids
    assert len(generated) == 150

    policy = quality.Policy("p", choice)
    (scored,) = quality.score(args, prompt + generated, [policy], LIMIT, CHUNK)
    served_lp = [lp.logprob for lp in served.outputs[0].logprobs]
    torch.testing.assert_close(
        torch.tensor(scored.logprobs[len(prompt) - 1 :]), torch.tensor(served_lp), atol=1e-5, rtol=0
    )
    # The same number of overflows or evictions, counted where the scheduler decides them.
    evicts = choice.policy in IMPORTANCE_POLICIES
    name = "kvserve:kv_evictions_total" if evicts else "kvserve:context_overflows_total"
    labels = {"policy": choice.policy}
    served_count = served_llm.engine.metrics.registry.get_sample_value(name, labels)
    scoring = quality.engine_for(args, LIMIT, 1)
    requests = quality.score_requests(prompt + generated, choice, LIMIT, CHUNK)
    scoring.generate([p for p, _ in requests], [s for _, s in requests])
    assert served_count >= 3
    assert scoring.engine.metrics.registry.get_sample_value(name, labels) == served_count


@pytest.mark.parametrize("layout", ["gemma3", "deepseek_v3"])
def test_every_layout_scores_every_policy(tmp_path, layout):
    """Gemma 3 (a window ring beside global layers) and MLA latents go through all the
    policies; until the context first fills, each equals the whole text in context."""
    save = save_tiny_gemma3 if layout == "gemma3" else save_tiny_deepseek_v3
    save(tmp_path, vocab_size=VOCAB, max_position_embeddings=512)
    tokens = random_prompt(2 * LIMIT + 8, VOCAB, seed=4)
    policies = [quality.Policy("full", None), *quality.policy_grid([0, 8], [None])]
    results = quality.score(base_args(tmp_path), tokens, policies, LIMIT, CHUNK)
    full = torch.tensor(results[0].logprobs)
    for r in results[1:]:
        lp = torch.tensor(r.logprobs)
        assert len(lp) == len(tokens) - 1 and torch.isfinite(lp).all()
        torch.testing.assert_close(lp[: LIMIT - 1], full[: LIMIT - 1], atol=2e-4, rtol=0)
        assert not torch.allclose(lp[LIMIT:], full[LIMIT:], atol=1e-3), r.policy.label


def test_the_command_writes_its_table_and_plot(smollm2_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(
        " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    )
    out = tmp_path / "out"
    code = tune.main([
        "--model", str(smollm2_dir), "--objective", "quality", "--text", str(text),
        "--max-model-len", "64", "--text-tokens", "160", "--chunk", "16", "--block-size", "8",
        "--n-keep", "0,4", "--kv-budgets", "0,32", "--kv-cache-dtype", "float32",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    table = (out / "quality.md").read_text()
    labels = ["full context", "truncate n_keep=0", "shift n_keep=0", "window (no sinks)",
              "truncate n_keep=4", "shift n_keep=4", "sink n_keep=4", "snapkv",
              "snapkv kv_budget=32", "h2o", "h2o kv_budget=32", "knorm",
              "knorm kv_budget=32"]  # fmt: skip
    for label in labels:
        assert f"| {label} |" in table
    data = json.loads((out / "quality.json").read_text())
    assert [r["policy"] for r in data["results"]] == labels
    assert all(len(r["logprobs"]) == 159 for r in data["results"])
    full = data["results"][0]
    assert 1 < full["perplexity"] < 1000
    # The float32 CPU run is the reference's twin; every policy matches it until overflow.
    assert full["kv_cache_dtype"] == "float32"
    assert full["divergence"]["kld_max"] == 0 and full["divergence"]["top1"] == 1
    for r in data["results"]:
        # A budget compresses the 48-token prompt at its end: its own rows are the full ones.
        same = 47 if "kv_budget" in r["policy"] else 63
        assert max(r["kld"][:same]) < 1e-6 and all(r["top1"][:same]), r["policy"]
        assert r["divergence"]["rows"] == 159
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_puts_each_points_perplexity_beside_its_throughput(smollm2_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Verse {i}: a rolling stone gathers no moss." for i in range(40)))
    out = tmp_path / "out"
    code = tune.main([
        "--model", str(smollm2_dir), "--objective", "quality", "--text", str(text),
        "--max-model-len", "64", "--text-tokens", "100", "--chunk", "16", "--block-size", "8",
        "--num-kv-blocks", "64", "--sweep", "context_overflow=sink,error,knorm",
        "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
        "--scrape-interval", "0", "--warmup", "0", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    lines = (out / "quality.md").read_text().splitlines()
    full = next(line for line in lines if "| full context |" in line)
    sink = next(line for line in lines if "context_overflow=sink" in line)
    error = next(line for line in lines if "context_overflow=error" in line)
    knorm = next(line for line in lines if "context_overflow=knorm" in line)
    ppl = [float(c) for line in (full, sink, knorm) for c in line.split("|")[5:7]]
    assert all(1 < v < 1000 for v in ppl)
    assert float(sink.split("|")[3]) > 0  # output tok/s measured for the same point
    assert error.split("|")[5].strip() == "-"  # error never goes past the context


# --- KL divergence and top-1 agreement against the float32-KV full context -----------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Heads of 32 values (int4 quantizes groups of 32), a vocabulary the API's logprobs cover."""
    path = tmp_path_factory.mktemp("wide-llama")
    model = save_tiny_llama(
        path, hidden_size=128, vocab_size=SMALL_VOCAB, max_position_embeddings=512
    )
    return path, model


def whole_distributions(records) -> torch.Tensor:
    """[n, vocab] logprobs from the API's records, whose top lists hold every token."""
    rows = torch.full((len(records), SMALL_VOCAB), math.nan, dtype=torch.float64)
    for i, record in enumerate(records):
        for token, logprob in record.top:
            rows[i, token] = logprob
    assert not rows.isnan().any()
    return rows


def api_rows(path, tokens: list[int], kv: str) -> torch.Tensor:
    """The whole next-token distributions of tokens[1:], read in one context, from the API
    (``kv``: a cache as ``quality.kv_settings`` names it)."""
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK,
              max_model_len=len(tokens) + 1, **quality.kv_settings(kv))  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=SMALL_VOCAB)
    (out,) = llm.generate([tokens], params)
    return whole_distributions(out.prompt_logprobs[1:])


def kl(ref: torch.Tensor, logq: torch.Tensor) -> np.ndarray:
    """KL(P_ref || Q) per row, by torch's own KL divergence."""
    return F.kl_div(logq, ref, log_target=True, reduction="none").sum(-1).numpy()


def test_a_cache_is_named_by_its_dtype_and_recent_tokens():
    assert quality.kv_settings("int8/int4") == dict(
        kv_cache_dtype="int8/int4", kv_cache_recent_tokens=0
    )
    assert quality.kv_settings("int4+128") == dict(
        kv_cache_dtype="int4", kv_cache_recent_tokens=128
    )
    with pytest.raises(ValueError, match="recent tokens"):
        quality.kv_settings("int4+x")


def test_a_kv_dtype_costs_what_the_apis_whole_distributions_say(wide):
    """float32 against itself costs nothing; int8, int8 keys beside int4 values and int4 cost
    a positive, finite KLD, int4 more than int8; every figure equals one computed from the
    API's logprobs of plain engines, whose float32 run is a transformers forward over the text."""
    path, model = wide
    tokens = random_prompt(160, SMALL_VOCAB, seed=5)
    kvs = ["float32", "int8", "int8/int4", "int4", "int4+40"]
    costs = quality.kv_dtype_costs(base_args(path), tokens, kvs)
    f32, i8, pair, i4, recent = (costs[kv] for kv in kvs)
    assert (f32.kld_mean, f32.kld_p99, f32.top1, f32.rows) == (0.0, 0.0, 1.0, 159)
    assert 0 < i8.kld_mean < i4.kld_mean < math.inf
    assert 0 < pair.kld_mean < math.inf
    assert 0 < recent.kld_mean < i4.kld_mean  # the last 40 tokens read unquantized
    assert i8.kld_p99 >= i8.kld_mean and i4.kld_p99 >= i4.kld_mean

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    reference = api_rows(path, tokens, "float32")
    torch.testing.assert_close(reference, torch.log_softmax(logits, -1), atol=2e-4, rtol=0)
    for cost in costs.values():
        rows = api_rows(path, tokens, cost.kv_cache_dtype)
        kld = kl(reference, rows)
        assert cost.kld_mean == pytest.approx(kld.mean(), rel=1e-4, abs=1e-9)
        assert cost.kld_p99 == pytest.approx(np.percentile(kld, 99), rel=1e-4, abs=1e-9)
        agree = (reference.argmax(-1) == rows.argmax(-1)).double().mean().item()
        assert cost.top1 == pytest.approx(agree)
        nll = -rows.gather(1, torch.tensor(tokens[1:])[:, None]).mean().item()
        assert cost.perplexity == pytest.approx(math.exp(nll), rel=1e-5)


def test_costs_over_a_range_of_rows_count_those_rows_only(wide):
    path, _ = wide
    tokens = random_prompt(128, SMALL_VOCAB, seed=7)
    rows = range(65, 128)  # llama-perplexity's half of a context of 128
    (cost,) = quality.kv_dtype_costs(base_args(path), tokens, ["int8"], rows).values()
    kld = kl(api_rows(path, tokens, "float32"), api_rows(path, tokens, "int8"))[64:]
    assert cost.rows == 63
    assert cost.kld_mean == pytest.approx(kld.mean(), rel=1e-4, abs=1e-9)


def test_each_rows_kld_under_a_policy_is_the_apis(wide):
    """Row by row, under shift (its forced rows after each shift) and truncate (its resent
    requests), with an int8 cache: the KLD and top-1 agreement from the rows taken inside the
    engine equal those of the same requests' whole distributions from the API."""
    path, _ = wide
    tokens = random_prompt(3 * LIMIT, SMALL_VOCAB, seed=6)
    base = base_args(path)
    reference = quality.reference_run(base, tokens)
    int8 = dataclasses.replace(base, kv_cache_dtype="int8")
    policies = [
        quality.Policy("shift", ContextOverflow("shift", 8, 16)),
        quality.Policy("truncate", ContextOverflow("truncate", 4)),
    ]
    results = quality.score(int8, tokens, policies, LIMIT, CHUNK, reference=reference)

    requests = [quality.score_requests(tokens, p.overflow, LIMIT, CHUNK) for p in policies]
    flat = [r for reqs in requests for r in reqs]
    llm = quality.engine_for(int8, LIMIT, len(flat))
    whole = [
        dataclasses.replace(
            s,
            logprobs=SMALL_VOCAB,
            prompt_logprobs=None if s.prompt_logprobs is None else SMALL_VOCAB,
        )
        for _, s in flat
    ]
    outputs = iter(llm.generate([p for p, _ in flat], whole))
    ref = api_rows(path, tokens, "float32")
    for result, reqs in zip(results, requests):
        records = []
        for out in [next(outputs) for _ in reqs]:
            records += (out.prompt_logprobs or [None])[1:] + out.outputs[0].logprobs
        rows = whole_distributions(records)
        np.testing.assert_allclose(result.kld, kl(ref, rows), rtol=1e-4, atol=1e-9)
        agree = (ref.argmax(-1) == rows.argmax(-1)).double().numpy()
        np.testing.assert_array_equal(result.top1, agree)
        assert result.divergence_after.kld_mean > 10 * result.divergence(1, LIMIT).kld_mean


def test_a_float32_policy_differs_from_the_reference_only_after_overflow(wide):
    path, _ = wide
    tokens = random_prompt(2 * LIMIT, SMALL_VOCAB, seed=8)
    base = base_args(path)
    reference = quality.reference_run(base, tokens)
    policies = [quality.Policy("full", None), quality.Policy("sink", ContextOverflow("sink", 8))]
    full, sink = quality.score(base, tokens, policies, LIMIT, CHUNK, reference=reference)
    assert full.divergence().kld_max == 0 and full.divergence().top1 == 1
    before = sink.divergence(1, LIMIT)
    assert before.kld_max < 1e-5 and before.top1 == 1  # float32 rounding, batched otherwise
    assert sink.divergence_after.kld_mean > 1e-3


def test_rows_outside_the_text_are_refused(wide):
    path, _ = wide
    tokens = random_prompt(32, SMALL_VOCAB, seed=9)
    for rows in (range(0, 10), range(5, 40), range(1, 10, 2)):
        with pytest.raises(ValueError, match="rows"):
            quality.kv_dtype_costs(base_args(path), tokens, ["int8"], rows)


def test_a_kv_dtype_sweep_puts_every_dtype_and_policy_in_one_table(worded_llama_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(
        " ".join(f"Stanza {i}: the owl and the pussycat went to sea." for i in range(30))
    )
    out = tmp_path / "out"
    code = tune.main([
        "--model", str(worded_llama_dir), "--objective", "quality", "--text", str(text),
        "--max-model-len", "128", "--text-tokens", "192", "--chunk", "16", "--block-size", "8",
        "--n-keep", "4", "--sweep", "kv_cache_dtype=float32,int8,int8/int4,int4", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    lines = (out / "quality.md").read_text().splitlines()
    head = next(line for line in lines if line.startswith("| KV cache"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    assert columns[5:] == ["mean KLD", "p99 KLD", "top-1 %", "mean KLD after overflow",
                           "top-1 % after overflow"]  # fmt: skip
    table = {}
    for line in lines[lines.index(head) + 2 :]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0], cells[1]] = dict(zip(columns, cells))
    policies = ["full context", "truncate n_keep=4", "shift n_keep=4", "sink n_keep=4",
                "snapkv", "h2o", "knorm"]  # fmt: skip
    # int4 keys refuse eviction by importance: their rows leave those policies out
    kvs = ("float32", "int8", "int8/int4")
    assert list(table) == [(kv, p) for kv in kvs for p in policies] + [
        ("int4", p) for p in policies[:4]
    ]
    assert table["float32", "full context"]["mean KLD"] == "0"
    assert table["float32", "full context"]["top-1 %"] == "100.00"
    klds = [float(table[kv, "full context"]["mean KLD"]) for kv in kvs[1:]]
    assert float(table["int4", "full context"]["mean KLD"]) > 0
    assert 0 < klds[0] < klds[1]
    data = json.loads((out / "quality.json").read_text())
    assert [r["kv_cache_dtype"] for r in data["results"]] == [kv for kv, _ in table]
    pair = data["results"][2 * len(policies)]["divergence"]
    assert pair["rows"] == 191 and pair["kld_mean"] == pytest.approx(klds[1], rel=1e-2)
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
