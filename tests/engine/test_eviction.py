"""Eviction by importance end to end on tiny random models: which tokens stay (against a naive
selection), what the model computes after an eviction (against transformers with the evicted
tokens masked out, layer by layer and head by head), the pool after every eviction, and the
interactions: prefix caching, preemption by swap and recompute, KV dtypes, the sliding-window
ring, MLA latents and speculative decoding."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.context_overflow import ContextOverflow
from engine.core.errors import RequestError
from engine.worker import eviction
from tests.helpers import (
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_gemma3,
    save_tiny_llama,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
BLOCK = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-evict")
    save_tiny_llama(path, max_position_embeddings=1024)
    return path


def make(path, **kw) -> LLM:
    args = dict(
        max_model_len=256, num_kv_blocks=64, block_size=BLOCK, device="cpu", dtype="float32",
        kv_cache_dtype="float32", kv_scores=True,
    )  # fmt: skip
    return LLM(str(path), **{**args, **kw})


def greedy(n: int, **overflow) -> SamplingParams:
    choice = ContextOverflow(**overflow) if overflow else None
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, overflow=choice)


def check_pool(llm: LLM) -> None:
    sched = llm.engine.scheduler
    live = [r.block_tables for r in sched.live_requests]
    llm.engine.kv.check_integrity(live)


# -- the selection --------------------------------------------------------------------------


def naive_choose(score, keep, sinks, window, per_head):
    h, n = score.shape
    sinks = min(sinks, keep)
    window = min(window, keep - sinks)
    out = []
    total = score.sum(0)
    for head in range(h):
        row = score[head] if per_head else total
        forced = set(range(sinks)) | set(range(n - window, n))
        rest = sorted((i for i in range(n) if i not in forced), key=lambda i: -float(row[i]))
        out.append(sorted(forced | set(rest[: keep - len(forced)])))
    return out


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("keep,sinks,window", [(10, 4, 3), (5, 4, 8), (7, 0, 0), (30, 4, 64)])
def test_choose_keeps_sinks_window_and_the_top_scores(keep, sinks, window, per_head):
    g = torch.Generator().manual_seed(keep)
    score = torch.randn(3, 40, generator=g)
    got = eviction.choose(score, keep, sinks, window, per_head)
    assert got.tolist() == naive_choose(score, keep, sinks, window, per_head)


def test_policies_score_as_they_say():
    keys = torch.randn(12, 2, 16)
    acc = torch.rand(12, 2)
    knorm = eviction.POLICIES["knorm"].score(keys, None)
    assert torch.equal(knorm, -keys.norm(dim=-1).T)
    assert torch.equal(eviction.POLICIES["h2o"].score(keys, acc), acc.T)
    snap = eviction.POLICIES["snapkv"].score(keys, acc)
    padded = torch.nn.functional.pad(acc.T, (2, 2))
    naive = torch.stack([padded[:, i : i + 5].sum(-1) / 5 for i in range(12)], dim=1)
    torch.testing.assert_close(snap, naive)


# -- what the model computes after an eviction ----------------------------------------------


class Recorder:
    """Records each layer's choice of every eviction, to replay it as attention masks."""

    def __init__(self, monkeypatch):
        self.chosen: list[torch.Tensor] = []
        choose = eviction.choose

        def recording(*args, **kw):
            idx = choose(*args, **kw)
            self.chosen.append(idx.clone())
            return idx

        monkeypatch.setattr(eviction, "choose", recording)

    def evictions(self, layers: int) -> list[list[torch.Tensor]]:
        assert len(self.chosen) % layers == 0
        return [self.chosen[i : i + layers] for i in range(0, len(self.chosen), layers)]


def allowed_keys(evictions, prompt_len: int, total: int, layers: int, heads: int):
    """[layers, heads, total, total] bool: which positions each query position may read, given
    the evictions in order (each, per layer, the kept slots of each head)."""
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed = allowed.expand(layers, heads, total, total).clone()
    slot_pos = [[list(range(prompt_len)) for _ in range(heads)] for _ in range(layers)]
    cached = prompt_len  # positions computed when the next eviction happens
    for i, per_layer in enumerate(evictions):
        for layer, idx in enumerate(per_layer):
            for h in range(heads):
                positions = slot_pos[layer][h]
                kept = [positions[j] for j in idx[h].tolist()]
                gone = sorted(set(positions) - set(kept))
                allowed[layer, h, cached:, gone] = False
                slot_pos[layer][h] = kept
        if i + 1 < len(evictions):  # decoding then adds tokens until the next one
            n_cached = len(slot_pos[0][0])
            add = BUDGET + BLOCK - n_cached
            for layer, h in itertools.product(range(layers), range(heads)):
                slot_pos[layer][h] += list(range(cached, cached + add))
            cached += add
    return allowed


def masked_attention(allowed):
    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        logits = query @ k.transpose(-1, -2) * scaling
        mask = allowed[module.layer_idx].repeat_interleave(groups, dim=0)
        logits = logits.masked_fill(~mask, float("-inf"))
        out = torch.softmax(logits, dim=-1) @ v
        return out.transpose(1, 2).contiguous(), None

    return attend


BUDGET = 24


@pytest.mark.parametrize(
    "policy,selection,backend",
    [("knorm", "head", "torch"), ("snapkv", "head", "cpu"), ("h2o", "layer", "torch"),
     ("h2o", "head", "cpu"), ("snapkv", "layer", "torch")],
)  # fmt: skip
def test_after_evictions_the_model_reads_exactly_the_kept_tokens(
    tiny_llama, monkeypatch, policy, selection, backend
):
    """Logits of every generated token against transformers over the whole sequence with the
    tokens each layer and head evicted masked out at their original positions."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    recorder = Recorder(monkeypatch)
    llm = make(tiny_llama, attention_backend=backend)
    prompt = random_prompt(60, VOCAB, seed=3)
    n = 2 * BLOCK + 6  # the prompt's eviction, then two more while decoding
    seen = []
    sample = llm.engine.runner.sampler.sample
    monkeypatch.setattr(
        llm.engine.runner.sampler, "sample",
        lambda logits, *a: (seen.append(logits[0].clone()), sample(logits, *a))[1],
    )  # fmt: skip
    overflow = dict(policy=policy, kv_budget=BUDGET, window=4, selection=selection)
    out = llm.generate([prompt], greedy(n, **overflow))[0].outputs[0].token_ids
    check_pool(llm)
    layers, heads = 2, 2
    evictions = recorder.evictions(layers)
    assert len(evictions) == 3
    tokens = prompt + out
    allowed = allowed_keys(evictions, len(prompt), len(tokens), layers, heads)
    AttentionInterface.register("kv_evicted", masked_attention(allowed))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="kv_evicted")
    with torch.no_grad():
        logits = ref(torch.tensor([tokens])).logits[0].float()
    want = logits[len(prompt) - 1 : len(tokens) - 1]
    torch.testing.assert_close(torch.stack(seen), want, atol=2e-4, rtol=1e-4)


def test_greedy_equals_the_full_cache_while_the_budget_is_not_reached(tiny_llama):
    llm = make(tiny_llama)
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (20, 37, 50)]
    full = llm.generate(prompts, greedy(30))
    for policy in ("snapkv", "h2o", "knorm"):
        outs = llm.generate(prompts, greedy(30, policy=policy, kv_budget=120))
        for a, b in zip(full, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, policy
    assert llm.engine.scheduler.num_preemptions == 0
    check_pool(llm)


def test_a_budget_returns_whole_blocks_to_the_pool(tiny_llama):
    llm = make(tiny_llama)
    engine = llm.engine
    engine.add_request("r", random_prompt(100, VOCAB), greedy(40, policy="snapkv", kv_budget=32))
    held = []
    while engine.has_unfinished:
        engine.step()
        check_pool(llm)
        if engine.scheduler.running:
            req = engine.scheduler.running[0]
            held.append(len(req.block_tables[0]))
            assert engine.kv.num_free_blocks == engine.kv.num_total_blocks - held[-1]
            assert req.num_cached_slots <= 32 + BLOCK
    # The prompt's 13 blocks go back when its prefill ends: the budget's 4 stay, and decoding
    # holds at most one block more.
    assert held[0] == 4 and max(held) == 5
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_context_overflow_evicts_and_generates_past_the_context(tiny_llama):
    llm = make(tiny_llama, max_model_len=64)
    out = llm.generate([random_prompt(40, VOCAB)], greedy(100, policy="h2o"))[0]
    assert len(out.outputs[0].token_ids) == 100
    assert out.outputs[0].finish_reason == "length"
    check_pool(llm)


def test_requests_choose_policies_and_bad_ones_get_400(tiny_llama):
    llm = make(tiny_llama, kv_scores=False)
    with pytest.raises(RequestError) as e:
        llm.generate([random_prompt(10, VOCAB)], greedy(4, policy="snapkv", kv_budget=16))
    assert e.value.param == "overflow.policy" and "--kv-scores" in e.value.message
    out = llm.generate([random_prompt(50, VOCAB)], greedy(4, policy="knorm", kv_budget=16))
    assert len(out[0].outputs[0].token_ids) == 4
    for bad in (dict(policy="shift", kv_budget=10), dict(policy="snapkv", kv_budget=3),
                dict(policy="h2o", selection="token"), dict(policy="h2o", window=-1),
                dict(policy="sink", window=8)):  # fmt: skip
        with pytest.raises(RequestError):
            ContextOverflow(**bad)
    for policy in ("shift", "knorm"):  # a discard longer than the context (256) cannot happen
        with pytest.raises(RequestError) as e:
            llm.generate([random_prompt(10, VOCAB)], greedy(4, policy=policy, n_discard=10**9))
        assert e.value.param == "overflow.n_discard"


def test_a_server_n_discard_longer_than_the_context_is_refused_at_start(tiny_llama):
    with pytest.raises(RequestError, match="n_discard"):
        make(tiny_llama, context_overflow="shift", context_n_discard=256)


def test_the_server_budget_applies_to_requests_without_their_own(tiny_llama):
    llm = make(tiny_llama, context_overflow="knorm", kv_budget=16)
    engine = llm.engine
    engine.add_request("a", random_prompt(50, VOCAB), greedy(3))
    engine.add_request("b", random_prompt(50, VOCAB), greedy(3, policy="knorm", kv_budget=0))
    slots = {}
    while engine.has_unfinished:
        engine.step()
        for req in engine.scheduler.running:
            slots[req.request_id] = req.num_cached_slots
    assert slots["a"] <= 16 + BLOCK and slots["b"] >= 50


# -- interactions ---------------------------------------------------------------------------


def test_evicted_blocks_are_not_shared_and_cached_prefixes_stay_right(tiny_llama):
    prompt = random_prompt(64, VOCAB, seed=9)
    plain = make(tiny_llama).generate([prompt], greedy(12))[0].outputs[0].token_ids
    llm = make(tiny_llama, enable_prefix_caching=True)
    evicting = greedy(12, policy="snapkv", kv_budget=24)
    llm.generate([prompt], evicting)
    check_pool(llm)
    # The first request's blocks were compacted: the prompt must be computed again, right.
    again = llm.generate([prompt, prompt], [greedy(12), evicting])
    assert again[0].outputs[0].token_ids == plain
    check_pool(llm)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_a_cached_prefix_leaves_the_scored_rows_to_compute(tiny_llama, policy):
    """The rows a policy scores by are computed even when the prefix cache holds them: the
    eviction then chooses as it does without a cache."""
    prompt = random_prompt(64, VOCAB, seed=11)
    evicting = greedy(12, policy=policy, kv_budget=24, window=4)
    want = make(tiny_llama).generate([prompt], evicting)[0].outputs[0].token_ids
    llm = make(tiny_llama, enable_prefix_caching=True)
    llm.generate([prompt], greedy(1))  # caches the whole prompt
    assert llm.generate([prompt], evicting)[0].outputs[0].token_ids == want
    # Requests sharing a prefix keep their scores apart.
    other = prompt[:40] + random_prompt(24, VOCAB, seed=12)
    alone = make(tiny_llama).generate([other], evicting)[0].outputs[0].token_ids
    both = llm.generate([prompt, other], evicting)
    assert [o.outputs[0].token_ids for o in both] == [want, alone]
    check_pool(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_evicting_requests_whole(tiny_llama, mode):
    # Two prompts of 5 blocks fit, not once both grow to the budget and a block more.
    prompts = [random_prompt(36, VOCAB, seed=s) for s in range(3)]
    params = greedy(30, policy="h2o", kv_budget=40)
    alone = [make(tiny_llama).generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm = make(tiny_llama, num_kv_blocks=11, preemption_mode=mode, swap_space_gib=0.01)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for o, want in zip(outs, alone):
        assert len(o.outputs[0].token_ids) == 30
        if mode == "swap":  # the same cache comes back; a recompute scores the prompt again
            assert o.outputs[0].token_ids == want
    check_pool(llm)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


@pytest.fixture(scope="module")
def llama_d32(tmp_path_factory):
    """Heads of 32 values: what quantized KV rows need."""
    path = tmp_path_factory.mktemp("tiny-llama-d32")
    save_tiny_llama(path, hidden_size=128, max_position_embeddings=1024)
    return path


@pytest.mark.parametrize("kv_dtype", ["int8", "int8/int4", "float16"])
def test_every_kv_dtype_evicts(llama_d32, kv_dtype):
    llm = make(llama_d32, kv_cache_dtype=kv_dtype)
    ref = make(llama_d32, kv_cache_dtype=kv_dtype, attention_backend="torch")
    prompt = random_prompt(70, VOCAB, seed=4)
    for policy in ("snapkv", "knorm"):
        params = greedy(20, policy=policy, kv_budget=32)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == ref.generate([prompt], params)[0].outputs[0].token_ids
        check_pool(llm)


def test_int4_keys_refuse_eviction_by_importance(llama_d32):
    """int4 keys are quantized per 32 tokens: compaction would move rows out of their groups."""
    from engine.core.errors import RequestError

    with pytest.raises(ValueError, match="int4 keys"):
        make(llama_d32, kv_cache_dtype="int4", kv_scores=False, context_overflow="knorm")
    llm = make(llama_d32, kv_cache_dtype="int4", kv_scores=False)
    with pytest.raises(RequestError, match="int4 keys"):
        llm.generate([random_prompt(70, VOCAB, seed=4)], greedy(4, policy="knorm", kv_budget=32))
    with pytest.raises(ValueError, match="importance scores"):
        make(llama_d32, kv_cache_dtype="int4")  # kv_scores


def test_sliding_window_layers_keep_their_window(tmp_path):
    save_tiny_gemma3(tmp_path)
    llm = make(tmp_path, max_model_len=128, num_kv_blocks=96)
    prompt = random_prompt(90, 256, seed=2)
    out = llm.generate([prompt], greedy(30, policy="snapkv", kv_budget=40))[0]
    assert len(out.outputs[0].token_ids) == 30
    check_pool(llm)


def test_mla_latents_evict(tmp_path):
    save_tiny_deepseek_v3(tmp_path)
    llm = make(tmp_path, max_model_len=128)
    prompt = random_prompt(70, 128, seed=5)
    ref = make(tmp_path, max_model_len=128, attention_backend="torch")
    for policy in ("h2o", "knorm"):
        params = greedy(20, policy=policy, kv_budget=24)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == ref.generate([prompt], params)[0].outputs[0].token_ids
    check_pool(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_eviction(tiny_llama, method):
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    if method == "draft_model":
        spec = dict(speculative_model=str(tiny_llama), num_speculative_tokens=3)
    llm = make(tiny_llama, **spec)
    prompt = random_prompt(40, VOCAB, seed=1) * 2  # repeats, for the n-gram drafts
    outs = llm.generate([prompt, prompt[:50]], greedy(40, policy="snapkv", kv_budget=32))
    for o in outs:
        assert len(o.outputs[0].token_ids) == 40
    check_pool(llm)
