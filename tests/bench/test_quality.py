"""Perplexity under a context policy: the teacher-forced scores against plain transformers
forwards over the context each policy leaves visible, scoring against serving, and the
``kvserve tune --objective quality`` report."""

from __future__ import annotations

import json

import pytest
import torch

from bench import quality, tune
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.context_overflow import ContextOverflow
from tests.helpers import random_prompt, save_tiny_deepseek_v3, save_tiny_gemma3, save_tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
LIMIT = 64
BLOCK = 8
CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path, vocab_size=VOCAB, max_position_embeddings=512)
    return path, model


def base_args(path) -> EngineArgs:
    return EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=BLOCK)


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


@pytest.mark.parametrize("choice", [ContextOverflow("shift", 8), ContextOverflow("sink", 0)])
def test_scoring_decides_as_serving_does(tiny, choice):
    """Forcing the tokens a served request generated repeats its every decision and score."""
    path, _ = tiny
    prompt = random_prompt(LIMIT - CHUNK, VOCAB, seed=3)
    served_llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK,
                     max_model_len=LIMIT, num_kv_blocks=32)  # fmt: skip
    serve = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True, logprobs=0,
                           overflow=choice)  # fmt: skip
    (served,) = served_llm.generate([prompt], serve)
    generated = served.outputs[0].token_ids
    assert len(generated) == 150

    policy = quality.Policy("p", choice)
    (scored,) = quality.score(base_args(path), prompt + generated, [policy], LIMIT, CHUNK)
    served_lp = [lp.logprob for lp in served.outputs[0].logprobs]
    torch.testing.assert_close(
        torch.tensor(scored.logprobs[len(prompt) - 1 :]), torch.tensor(served_lp), atol=1e-5, rtol=0
    )
    # The same number of context overflows, counted where the scheduler decides them.
    name = "kvserve:context_overflows_total"
    labels = {"policy": choice.policy}
    served_count = served_llm.engine.metrics.registry.get_sample_value(name, labels)
    scoring = quality.engine_for(base_args(path), LIMIT, 1)
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
        "--n-keep", "0,4", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    table = (out / "quality.md").read_text()
    labels = ["full context", "truncate n_keep=0", "shift n_keep=0", "window (no sinks)",
              "truncate n_keep=4", "shift n_keep=4", "sink n_keep=4"]  # fmt: skip
    for label in labels:
        assert f"| {label} |" in table
    data = json.loads((out / "quality.json").read_text())
    assert [r["policy"] for r in data["results"]] == labels
    assert all(len(r["logprobs"]) == 159 for r in data["results"])
    full = data["results"][0]
    assert 1 < full["perplexity"] < 1000
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_puts_each_points_perplexity_beside_its_throughput(smollm2_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Verse {i}: a rolling stone gathers no moss." for i in range(40)))
    out = tmp_path / "out"
    code = tune.main([
        "--model", str(smollm2_dir), "--objective", "quality", "--text", str(text),
        "--max-model-len", "64", "--text-tokens", "100", "--chunk", "16", "--block-size", "8",
        "--num-kv-blocks", "64", "--sweep", "context_overflow=sink,error",
        "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
        "--scrape-interval", "0", "--warmup", "0", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    lines = (out / "quality.md").read_text().splitlines()
    full = next(line for line in lines if "| full context |" in line)
    sink = next(line for line in lines if "context_overflow=sink" in line)
    error = next(line for line in lines if "context_overflow=error" in line)
    ppl = [float(c) for c in full.split("|")[5:7]] + [float(c) for c in sink.split("|")[5:7]]
    assert all(1 < v < 1000 for v in ppl)
    assert float(sink.split("|")[3]) > 0  # output tok/s measured for the same point
    assert error.split("|")[5].strip() == "-"  # error never goes past the context
