"""Overflow policies through the engine with real model classes.

Context shift, against an oracle that holds for any model: a layer-0 key depends only on its
token and position, so after a shift the shifted engine's layer-0 cache rows must equal those
of a fresh engine that prefills the shifted tokens at their new positions. Tiny random models
cover an MLA latent row (DeepSeek-V3) and a sliding-window ring that has wrapped (Gemma 3);
SmolLM2 covers a full Llama cache and generation three times past max_model_len.

Pool overflow: a pool too small for the load preempts, by recompute and by swap, and every
request still ends with the greedy tokens it has alone.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import reference
from tests.helpers import random_prompt, save_tiny_deepseek_v3, save_tiny_gemma3

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def cached_rows(llm: LLM, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s cached key rows the next token of a running request attends to."""
    engine = llm.engine
    req = engine.scheduler.requests[request_id]
    gi = engine.runner.layer_to_group[layer]
    window = engine.runner.groups[gi].spec.window
    n = req.num_computed_tokens
    pos = torch.arange(max(0, n - window + 1) if window else 0, n)
    table = torch.tensor(req.block_tables[gi], dtype=torch.int32)
    rows = reference.gather_cache(engine.runner.kv_caches[layer][0], table, pos, window)
    return rows, pos


def shift_once(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Generates until the context has shifted and the next step has run on the shifted cache.

    Returns the tokens the cache then holds, in position order.
    """
    engine = llm.engine
    engine.add_request("shifted", prompt, greedy(max_tokens))
    req = engine.scheduler.requests["shifted"]
    while req.num_dropped_tokens == 0:
        engine.step()
    engine.step()
    return req.token_ids[: req.num_computed_tokens]


def assert_layer0_rows_equal_a_fresh_prefill(model_dir, llm: LLM, cached: list[int], **kw):
    fresh = LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        kv_cache_dtype="float32",
        block_size=BLOCK,
        **kw,
    )
    fresh.engine.add_request("fresh", cached, greedy(2))
    fresh.engine.step()
    got, pos = cached_rows(llm, "shifted", 0)
    want, want_pos = cached_rows(fresh, "fresh", 0)
    assert torch.equal(pos, want_pos) and len(pos) > 0
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def run_to_end(llm: LLM) -> None:
    engine = llm.engine
    while engine.has_unfinished:
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.kv.check_integrity([])


# ---- tiny random models ----


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek")
    save_tiny_deepseek_v3(path)
    return path


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_gemma3(path)
    return path


def test_shift_of_an_mla_cache_rotates_only_the_rope_tail(tiny_deepseek):
    kw = dict(max_model_len=64, num_kv_blocks=8)
    llm = LLM(str(tiny_deepseek), device="cpu", dtype="float32", kv_cache_dtype="float32",
              block_size=BLOCK,
              context_overflow="shift", **kw)  # fmt: skip
    cached = shift_once(llm, random_prompt(40, 128), max_tokens=120)
    assert len(cached) == 63 - 32 + 1  # keep 16, drop 32 of 63 cached, then one more
    assert_layer0_rows_equal_a_fresh_prefill(tiny_deepseek, llm, cached, **kw)
    run_to_end(llm)


def test_shift_of_a_wrapped_ring_keeps_its_window_in_place(tiny_gemma3):
    # window 32, block 16: a ring of 3 blocks, wrapped long before max_model_len 96.
    kw = dict(max_model_len=96, num_kv_blocks=12)
    llm = LLM(str(tiny_gemma3), device="cpu", dtype="float32", kv_cache_dtype="float32",
              block_size=BLOCK,
              context_overflow="shift", **kw)  # fmt: skip
    assert llm.engine.runner.groups[0].spec.window == 32
    cached = shift_once(llm, random_prompt(50, 256), max_tokens=200)
    # keep 16; half the rest is 40 -> 48, which the next window, [n - 31, n], allows: it must
    # clear the kept tokens, 95 - 16 - 31 = 48. Three blocks turn a ring of three in place.
    assert len(cached) == 95 - 48 + 1
    assert_layer0_rows_equal_a_fresh_prefill(tiny_gemma3, llm, cached, **kw)
    run_to_end(llm)


def test_shift_by_part_of_a_ring_turns_its_table(tiny_gemma3):
    # Two blocks of a ring of three: position p - 32 is now looked up one entry further on.
    kw = dict(max_model_len=96, num_kv_blocks=12)
    llm = LLM(str(tiny_gemma3), device="cpu", dtype="float32", kv_cache_dtype="float32",
              block_size=BLOCK,
              context_overflow="shift", context_n_discard=32, **kw)  # fmt: skip
    cached = shift_once(llm, random_prompt(50, 256, seed=1), max_tokens=200)
    assert len(cached) == 95 - 32 + 1
    assert_layer0_rows_equal_a_fresh_prefill(tiny_gemma3, llm, cached, **kw)
    run_to_end(llm)


# ---- SmolLM2 ----


@pytest.mark.slow
def test_shifted_llama_cache_equals_a_fresh_prefill_at_new_positions(smollm2_dir):
    kw = dict(max_model_len=128, num_kv_blocks=10)
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32", kv_cache_dtype="float32",
              block_size=BLOCK,
              context_overflow="shift", context_n_keep=20, **kw)  # fmt: skip
    prompt = llm.tokenizer.encode("The city began as a small fishing village by the sea. " * 12)
    cached = shift_once(llm, prompt[:110], max_tokens=40)
    assert len(cached) == 127 - 48 + 1  # keep 20 -> 32, drop half of 96
    assert_layer0_rows_equal_a_fresh_prefill(smollm2_dir, llm, cached, **kw)
    run_to_end(llm)


def longest_run(tokens: list[int]) -> int:
    best = run = 1
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.float32
    ).eval()


def mean_nll(model, context: list[int], continuation: list[int]) -> float:
    """Mean negative log-likelihood of ``continuation`` after ``context``, by a fresh model."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    nll = -logprobs.gather(1, ids[0, 1:, None])[:, 0]
    return nll[len(context) - 1 :].mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["shift", "sink"])
def test_generation_runs_three_times_past_max_model_len(smollm2_dir, hf_smollm2, policy):
    limit = 128
    llm = LLM(str(smollm2_dir), max_model_len=limit, num_kv_blocks=12, block_size=BLOCK,
              device="cpu", context_overflow=policy)  # fmt: skip
    chat = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
    prompt = llm.tokenizer.encode_chat(chat, True)
    max_tokens = 3 * limit - len(prompt)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, repetition_penalty=1.2
    )
    (out,) = llm.generate([prompt], params)
    tokens, text = out.outputs[0].token_ids, out.outputs[0].text
    assert out.outputs[0].finish_reason == "length" and len(tokens) == max_tokens
    assert text == llm.tokenizer.decode(tokens) and "\ufffd" not in text
    assert longest_run(tokens) < 8  # no single-token loop
    for start in range(0, len(tokens) - 64, 64):
        assert len(set(tokens[start : start + 64])) > 24, text  # nor a short one
    # The text after the last shifts is text the model finds likely, read afresh without any
    # shift: about 1.4 nats a token here, and 3.7 when the keys are left unrotated.
    assert mean_nll(hf_smollm2, tokens[-256:-128], tokens[-128:]) < 2.5, text
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    overflows = engine.metrics.context_overflows.labels(policy)._value.get()
    assert overflows >= (3 if policy == "shift" else 16)


@pytest.fixture(scope="module")
def alone(smollm2_dir):
    """Prompts and the greedy tokens each gets with the pool to itself."""
    llm = LLM(str(smollm2_dir), max_model_len=128, num_kv_blocks=40, block_size=BLOCK,
              device="cpu")  # fmt: skip
    texts = [
        "The capital of France is",
        "Here is a recipe for pancakes:",
        "A short poem about the sea:",
        "def fibonacci(n):",
        "The three laws of motion are",
    ]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    outs = llm.generate(prompts, greedy(40))
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_finish_with_the_tokens_they_get_alone(smollm2_dir, alone, mode):
    prompts, expected = alone
    # Five requests of up to ~50 tokens need 4 blocks each; the pool has 8.
    llm = LLM(str(smollm2_dir), max_model_len=128, num_kv_blocks=8, block_size=BLOCK,
              device="cpu", preemption_mode=mode, swap_space_gib=0.05)  # fmt: skip
    outs = llm.generate(prompts, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = llm.engine
    preemptions = engine.metrics.preemptions.labels(mode)._value.get()
    assert preemptions > 0 and engine.scheduler.num_preemptions == preemptions
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.kv.num_free_host_blocks == engine.kv.num_total_host_blocks
    if mode == "swap":
        swapped = engine.metrics.swapped_blocks
        assert swapped.labels("out")._value.get() == swapped.labels("in")._value.get() > 0
