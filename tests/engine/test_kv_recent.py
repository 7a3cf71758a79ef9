"""The engine keeping each sequence's last tokens beside a quantized cache
(``--kv-cache-recent-tokens``): against transformers reading a token's recent keys and values
as they are and older ones quantized (``bench.kv_schemes``' attention, one token a block), with
prefix caching, preemption, a shifting context and speculative decoding; the pools whole after
every run."""

from __future__ import annotations

import pytest
import torch

from bench import kv_schemes
from engine import LLM
from engine.capacity import make_plan
from models.kv_spec import kv_pair
from tests.engine import test_kv_dtypes
from tests.engine.test_kv_dtypes import assert_pool_whole, greedy, tokens
from tests.helpers import generate_with_logits, random_prompt, save_tiny_gemma3, save_tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
RECENT = 12  # tokens: over one block of 8 and a part of the next, so a ring turns
LLAMA = dict(vocab_size=VOCAB, hidden_size=128, attention_bias=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-recent")
    save_tiny_llama(root / "llama", **LLAMA)
    save_tiny_gemma3(root / "gemma3", vocab_size=VOCAB)
    return root


def make(path, kv: str, recent: int = RECENT, **kw) -> LLM:
    return test_kv_dtypes.make(path, kv, kv_cache_recent_tokens=recent, **kw)


@pytest.mark.parametrize(
    "backend,kv",
    [("cpu", "int4"), ("cpu", "int8/int4"), ("torch", "int4"), ("triton", "int8/int4")],
)
def test_logits_are_transformers_reading_older_tokens_quantized_and_recent_ones_not(
    models, kv, backend, monkeypatch
):
    from transformers import AutoModelForCausalLM

    llm = make(models / "llama", kv, attention_backend=backend)
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (5, 40, 70)]
    results = generate_with_logits(llm, prompts, monkeypatch, max_tokens=12)
    hf = AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.float32).eval()
    attention = kv_schemes.attach(hf)
    layers = llm.engine.runner.model.model.layers
    attention.offsets = [layer.self_attn.key_offset[None, :, None, :] for layer in layers]
    sides = kv_schemes.sides()
    key, value = kv_pair(kv)
    # int4 keys: per channel (and at least 32 recent tokens); as the engine's recent rows give
    # them back, in float16, which the groups are quantized from.
    key = sides["int4 keys" if key == "int4" else key]
    window = llm.engine.runner.groups[-1].spec.window
    assert window == (32 if kv == "int4" else RECENT)
    errors = {}
    for recent in (window, 0):  # one token a block: the last ``window`` tokens as they are
        attention.scheme = kv_schemes.Scheme(key, sides[value], recent, 1, torch.float16)
        errors[recent] = []
        for prompt, (out, logits) in zip(prompts, results):
            ids = torch.tensor([prompt + out[:-1]])
            with torch.no_grad():
                expect = hf(ids).logits[0, len(prompt) - 1 :]
            ours, theirs = logits.log_softmax(-1), expect.log_softmax(-1)
            errors[recent].append((ours - theirs).abs().mean().item())
            if recent:
                assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    # Within int4's tolerance of the oracle (test_kv_dtypes: a value on the other side of a
    # rounding boundary moves a logit by a step), and far from reading every token quantized.
    assert max(errors[window]) < 3e-2, errors
    assert max(errors[window]) < min(errors[0]) / 10, errors
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "model,kv", [("llama", "int8/int4"), ("gemma3", "fp8_e4m3/int4"), ("llama", "int4")]
)
def test_the_fused_cpu_layers_read_the_window_as_the_torch_backend(models, model, kv, monkeypatch):
    """Decodes beside prefill chunks (a budget of 16 tokens a step), through the C++ decoder
    layers, which write and read the recent rows themselves (int4 keys: in decode steps, which
    write the groups their tokens complete)."""
    from kernels import cpu

    calls = []
    fused = cpu.decoder_layers
    monkeypatch.setattr(cpu, "decoder_layers", lambda *a, **k: calls.append(1) or fused(*a, **k))
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (3, 30, 45)]
    outs, keys = {}, {}
    for backend in ("cpu", "torch"):
        llm = make(models / model, kv, attention_backend=backend, max_num_batched_tokens=16)
        outs[backend] = tokens(llm.generate(prompts, greedy(30)))
        keys[backend] = llm.engine.runner.kv_caches[0][0]
        assert_pool_whole(llm)
    assert calls and outs["cpu"] == outs["torch"]
    if kv == "int4":  # the groups decode steps complete, written by the C++ layers byte for byte
        assert torch.equal(keys["cpu"], keys["torch"])


def test_a_window_past_the_context_is_the_float_cache(models):
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (7, 30)]
    whole = tokens(make(models / "llama", "int4", recent=200).generate(prompts, greedy(20)))
    assert whole == tokens(
        make(models / "llama", "float16", recent=0).generate(prompts, greedy(20))
    )


@pytest.mark.parametrize("model,kv", [("llama", "int4"), ("gemma3", "int8/int4")])
def test_prefix_caching_and_preemption_give_the_tokens_of_a_request_alone(models, model, kv):
    """Cached prefix blocks come with their recent tokens' blocks (a ring hit, as a sliding
    window's), and requests preempted by swap or recompute give the tokens each gets alone."""
    shared = random_prompt(40, VOCAB, seed=1)  # a whole block of 32 (int4 keys' blocks)
    prompts = [shared + random_prompt(4 + i, VOCAB, seed=10 + i) for i in range(6)]
    params = [greedy(24 + 2 * i) for i in range(6)]
    alone = [tokens(make(models / model, kv).generate([p], q))[0] for p, q in zip(prompts, params)]
    blocks = 4 if kv == "int4" else 16  # of 32 tokens or 8
    for mode in ("recompute", "swap"):
        llm = make(models / model, kv, num_kv_blocks=blocks, preemption_mode=mode,
                   swap_space_gib=0.01)  # fmt: skip
        assert tokens(llm.generate(prompts, params)) == alone
        registry = llm.engine.metrics.registry
        assert registry.get_sample_value("kvserve:num_preemptions_total", {"mode": mode})
        assert registry.get_sample_value("kvserve:prefix_cache_hits_total")
        assert_pool_whole(llm)


def test_a_shifting_context_and_speculation_keep_the_window(models):
    from engine.core.context_overflow import ContextOverflow

    prompt = random_prompt(20, VOCAB, seed=3)
    params = greedy(150, overflow=ContextOverflow("shift", 4, 16))
    llm = make(models / "llama", "int8/int4", max_model_len=48)
    assert len(tokens(llm.generate([prompt], params))[0]) == 150
    assert_pool_whole(llm)
    repeat = random_prompt(12, VOCAB, seed=4)
    prompts = [repeat * 3, random_prompt(30, VOCAB, seed=5)]
    plain = tokens(make(models / "llama", "int4").generate(prompts, greedy(30)))
    llm = make(models / "llama", "int4", speculative_method="ngram", num_speculative_tokens=3)
    assert tokens(llm.generate(prompts, greedy(30))) == plain
    assert_pool_whole(llm)


def test_the_recent_tokens_are_a_group_of_their_own_in_the_plan(models):
    llm = make(models / "llama", "int8/int4")
    groups = llm.engine.runner.groups
    assert [g.recent for g in groups] == [False, True]
    assert groups[1].spec.window == RECENT and groups[1].spec.dtype == "float16"
    assert groups[1].layer_ids == (2, 3)  # the model's two layers, past its layer count
    plan = make_plan(str(models / "llama"), 0.01, 128, 8, "float32", kv_cache_dtype="int8",
                     kv_recent_tokens=RECENT)  # fmt: skip
    assert [r.kind for r in plan.rows] == ["FullAttentionSpec", f"RecentTokens(window={RECENT})"]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(kv="float16"), "quantized"),
        (dict(kv="int8", kv_scores=True), "importance scores"),
        (dict(kv="int8", context_overflow="snapkv"), "importance scores"),
        (dict(kv="int8", recent=-1), "kv_cache_recent_tokens"),
        (dict(kv="int8", kv_host_cache_gib=0.01), "host-cache"),
    ],
)
def test_what_the_window_refuses(models, kw, match):
    kw = dict(kw)
    with pytest.raises(ValueError, match=match):
        make(models / "llama", kw.pop("kv"), **kw)


def test_an_mla_cache_refuses_the_window(tmp_path):
    from tests.helpers import save_tiny_deepseek_v3

    save_tiny_deepseek_v3(tmp_path, vocab_size=VOCAB, kv_lora_rank=64, qk_rope_head_dim=64,
                          qk_nope_head_dim=32)  # fmt: skip
    with pytest.raises(ValueError, match="MLA"):
        make(tmp_path, "int8")
