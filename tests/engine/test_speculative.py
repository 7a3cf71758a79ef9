"""Speculative decoding through the engine: n-gram prompt lookup and draft models.

The oracle is the same engine without speculation: greedy tokens (and their logprobs, stops,
structured outputs) must be identical, whatever was drafted, accepted, rejected, preempted,
swapped, shifted or served from the prefix cache. The pools are checked after every step, and
the speculation counters against each other and against the tokens produced.

Tiny random Llamas do most of the work (no tokenizer: prompts are token ids); as drafts, the
same checkpoint (every draft accepted) and a perturbed copy (about a third accepted). Qwen2.5-
Coder-0.5B covers real text: a prompt that repeats itself, a stop string, a JSON schema.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.sampling_params import Constraint
from tests.helpers import (
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_gemma3,
    save_tiny_llama,
    tiny_llama,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128  # the tiny Llama's
BLOCK = 8


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory):
    """The tiny Llama with every weight perturbed: a draft that agrees with it often, not always
    (about a third of 4-token drafts' tokens are accepted)."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    path = tmp_path_factory.mktemp("other-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_vocab_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("small-vocab-llama")
    save_tiny_llama(path, vocab_size=96)
    return path


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir, other_llama_dir, small_vocab_llama_dir):
    """Speculative settings by name: prompt lookup, and three draft models."""
    return {
        "ngram": dict(speculative_method="ngram"),
        "self": dict(speculative_model=str(tiny_llama_dir)),
        "other": dict(speculative_model=str(other_llama_dir)),
        "small-vocab": dict(speculative_model=str(small_vocab_llama_dir)),
    }


def make(model_dir, spec: dict | None = None, k: int | None = 4, **kw) -> LLM:
    # float32 keys and values: a row a prefill reads back then equals the one a decode wrote.
    args = dict(num_kv_blocks=64, block_size=BLOCK, max_num_batched_tokens=256, device="cpu",
                dtype="float32", kv_cache_dtype="float32")  # fmt: skip
    if spec is not None:
        args.update(spec, num_speculative_tokens=k)
    return LLM(str(model_dir), **{**args, **kw})


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **{"ignore_eos": True, **kw})


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached: int = 0


@dataclass
class Run:
    results: list[Result]
    sampled_rows: int = 0  # (request, step) pairs that sampled: each gives one token + accepted
    drafted: dict[str, int] = field(default_factory=Counter)  # draft slots per request
    max_per_step: int = 0  # most tokens one request got in one step


def run(llm: LLM, waves: list[list[tuple[list[int], SamplingParams]]]) -> Run:
    """Each wave's requests together, a wave after the last one ended; the pools are checked
    after every step, and every step's schedule is recorded."""
    engine, sched = llm.engine, llm.engine.scheduler
    out = Run([])
    schedule = sched.schedule

    def recording_schedule():
        plan = schedule()
        for s in plan.scheduled:
            out.sampled_rows += s.sample
            out.drafted[s.request_id] += s.num_drafts
        return plan

    sched.schedule = recording_schedule
    n = 0
    try:
        for wave in waves:
            for prompt, params in wave:
                engine.add_request(f"r{n}", prompt, params)
                out.results.append(Result())
                n += 1
            while engine.has_unfinished:
                for delta in engine.step():
                    r, c = out.results[int(delta.request_id[1:])], delta.outputs[0]
                    assert c.error is None, c.error
                    r.tokens += c.token_ids
                    r.logprobs += c.logprobs or []
                    r.text += c.text
                    r.finish_reason, r.stop_reason = c.finish_reason, c.stop_reason
                    r.cached = delta.num_cached_tokens
                    out.max_per_step = max(out.max_per_step, len(c.token_ids))
                live = sched.live_requests
                engine.kv.check_integrity(
                    [r.block_tables for r in live], [r.host_tables for r in live]
                )
                # The blocks of rejected drafts went back: a running sequence holds no block
                # past its tokens.
                size = engine.kv.block_size
                for req in sched.running:
                    assert len(req.block_tables[0]) <= -(-req.num_tokens // size), req.request_id
    finally:
        del sched.schedule
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.kv.num_free_host_blocks == engine.kv.num_total_host_blocks
    return out


def spec_counts(llm: LLM) -> tuple[float, float, list[float]]:
    """(drafted, accepted, accepted by position) from the metrics, checked for consistency."""
    m = llm.engine.metrics
    method = llm.engine.speculation.method
    drafted = m.spec_draft_tokens.labels(method)._value.get()
    accepted = m.spec_accepted_tokens.labels(method)._value.get()
    per_pos = [m.spec_accepted_per_pos.labels(method, str(i))._value.get() for i in range(9)]
    assert 0 <= accepted <= drafted
    assert sum(per_pos) == accepted
    # A draft is accepted only after the ones before it in its run.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    return drafted, accepted, per_pos


def check_counts(llm: LLM, r: Run, k: int | None = 4) -> tuple[float, float]:
    """The counters agree with the schedules and the tokens (for runs without stops before
    max_tokens): each sampling row gives one token plus the drafts accepted there."""
    drafted, accepted, per_pos = spec_counts(llm)
    assert drafted == sum(r.drafted.values())
    assert sum(len(x.tokens) for x in r.results) == r.sampled_rows + accepted
    if k is not None:
        assert r.max_per_step <= k + 1
        assert not any(per_pos[k:])
    return drafted, accepted


def prompts_and_params(count: int = 4, base: int = 24) -> list[tuple[list[int], SamplingParams]]:
    """Requests of different prompt and output lengths."""
    return [(random_prompt(base + 9 * i, VOCAB, seed=i), greedy(29 + 6 * i)) for i in range(count)]


# -- greedy: the same tokens with speculation on and off ----------------------------------------


@pytest.mark.parametrize("k", [4, None], ids=["k4", "adaptive"])
@pytest.mark.parametrize("name", ["ngram", "self", "other"])
def test_greedy_tokens_are_the_same_with_speculation_on_and_off(tiny_llama_dir, drafts, name, k):
    waves = [prompts_and_params()]
    plain = run(make(tiny_llama_dir), waves)
    llm = make(tiny_llama_dir, drafts[name], k)
    spec = run(llm, waves)
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]
    assert all(x.finish_reason == "length" for x in spec.results)
    drafted, accepted = check_counts(llm, spec, k)
    if k is not None:  # a fixed length always drafts (where the method proposes anything)
        assert drafted > 0
        assert spec.sampled_rows < plain.sampled_rows or name == "ngram"
    if name == "self":  # the target agrees with itself
        assert accepted == drafted
        if k is not None:
            assert spec.max_per_step == k + 1
    if name == "other" and k is not None:  # partly accepted: both paths taken
        assert 0 < accepted < drafted


def test_an_adaptive_ngram_engine_drafts_where_the_context_repeats(tiny_llama_dir):
    # A prompt that repeats: prompt lookup proposes what followed; a decode step of a tiny model
    # costs about the same for 1 row as for 9, so drafting pays from the first step.
    unit = random_prompt(12, VOCAB, seed=5)
    waves = [[(unit * 4, greedy(40)), (random_prompt(30, VOCAB, seed=6) * 2, greedy(35))]]
    plain = run(make(tiny_llama_dir), waves)
    llm = make(tiny_llama_dir, dict(speculative_method="ngram"), k=None)
    spec = run(llm, waves)
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]
    drafted, _ = check_counts(llm, spec, k=None)
    assert drafted > 0


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """Sliding-window layers (a ring of blocks, window 32) beside full-attention ones."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_gemma3(path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def tiny_mla_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mla")
    save_tiny_deepseek_v3(path)
    return path


@pytest.mark.parametrize("method", ["ngram", "self"])
@pytest.mark.parametrize("model", ["tiny_gemma3_dir", "tiny_mla_dir"])
def test_other_cache_layouts_give_the_same_tokens(request, model, method):
    # Gemma 3's sliding window wraps its ring several times: rejected drafts must not write over
    # positions the window still reads. DeepSeek-V3 caches MLA latents.
    model_dir = request.getfixturevalue(model)
    spec = dict(speculative_method="ngram") if method == "ngram" else None
    spec = spec or dict(speculative_model=str(model_dir))
    waves = [
        [(random_prompt(40 + 11 * i, VOCAB, seed=80 + i), greedy(60 - 9 * i)) for i in range(3)]
    ]
    plain = run(make(model_dir), waves)
    llm = make(model_dir, spec)
    got = run(llm, waves)
    assert [x.tokens for x in got.results] == [x.tokens for x in plain.results]
    drafted, accepted = check_counts(llm, got)
    assert drafted > 0 and (method == "ngram" or accepted == drafted)


def test_aborting_a_speculating_request_frees_its_blocks(tiny_llama_dir, drafts):
    for name in ("ngram", "other"):
        llm = make(tiny_llama_dir, drafts[name])
        engine = llm.engine
        requests = prompts_and_params(3)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
        tokens = {f"r{i}": [] for i in range(3)}
        steps = 0
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].token_ids
            steps += 1
            if steps == 5:
                assert engine.scheduler.requests["r1"].num_computed_tokens > 0
                assert engine.abort("r1").outputs[0].finish_reason == "abort"
            live = engine.scheduler.live_requests
            engine.kv.check_integrity([r.block_tables for r in live], [r.host_tables for r in live])
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        plain = run(make(tiny_llama_dir), [requests[::2]]).results
        assert [tokens["r0"], tokens["r2"]] == [x.tokens for x in plain]
        assert 0 < len(tokens["r1"]) < requests[1][1].max_tokens


# -- Qwen2.5-Coder-0.5B: real text ------------------------------------------------------------

LIST_PROMPT = (
    "Repeat this list exactly:\n1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n"
    "6. fig\n7. grape\n8. honeydew\n9. kiwi\n10. lemon\n11. mango\n12. nectarine"
)
JSON_PROMPT = (
    'Repeat this JSON exactly: {"name": "kvserve", "version": "1.0", "features": ["paged '
    'attention", "prefix caching", "speculative decoding", "structured output"], "license": '
    '"MIT"}'
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "features": {"type": "array", "items": {"type": "string"}},
        "license": {"type": "string"},
    },
    "required": ["name", "version", "features", "license"],
    "additionalProperties": False,
}


def qwen(path, **kw) -> LLM:
    return LLM(str(path), num_kv_blocks=256, max_model_len=2048, **kw)


@pytest.fixture(scope="module")
def qwen_engines(qwen05_dir):
    """Qwen without speculation, with n-gram lookup, and drafting for itself (4 tokens)."""
    return {
        "plain": qwen(qwen05_dir),
        "ngram": qwen(qwen05_dir, speculative_method="ngram", num_speculative_tokens=4),
        "self": qwen(qwen05_dir, speculative_model=str(qwen05_dir), num_speculative_tokens=4),
        "baselines": {},
    }


def baseline(engines: dict, waves) -> list[Result]:
    """The plain engine's results for ``waves``, computed once per module."""
    key = repr(waves)
    if key not in engines["baselines"]:
        engines["baselines"][key] = run(engines["plain"], waves).results
    return engines["baselines"][key]


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "self"])
def test_qwen_repeating_a_list_gives_the_same_text_with_fewer_steps(qwen_engines, name):
    plain, llm = qwen_engines["plain"], qwen_engines[name]
    waves = [[(chat(plain, LIST_PROMPT), SamplingParams(max_tokens=48, temperature=0))]]
    want = baseline(qwen_engines, waves)[0]
    assert len(want.tokens) == 48 and "5. elderberry\n6. fig" in want.text
    before = spec_counts(llm)
    got = run(llm, waves)
    (result,) = got.results
    assert (result.tokens, result.text, result.finish_reason) == (
        want.tokens, want.text, want.finish_reason,
    )  # fmt: skip
    after = spec_counts(llm)
    assert after[1] - before[1] > 10  # drafts were accepted
    assert got.sampled_rows < 48 - 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "self"])
def test_qwen_a_stop_string_inside_accepted_drafts_ends_where_it_does_without(qwen_engines, name):
    plain, llm = qwen_engines["plain"], qwen_engines[name]
    kept = dict(include_stop_str_in_output=True)
    params = [
        SamplingParams(max_tokens=48, temperature=0, stop=["fig"]),
        SamplingParams(max_tokens=48, temperature=0, stop=["grape"], **kept),
    ]
    waves = [[(chat(plain, LIST_PROMPT), p) for p in params]]
    want = baseline(qwen_engines, waves)
    assert want[0].text.endswith("6. ") and want[1].text.endswith("7. grape")
    before = spec_counts(llm)
    got = run(llm, waves).results
    assert spec_counts(llm)[1] - before[1] > 5
    for g, w in zip(got, want):
        assert (g.tokens, g.text, g.finish_reason, g.stop_reason) == (
            w.tokens, w.text, "stop", w.stop_reason,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "self"])
def test_qwen_structured_output_with_drafts_matches_the_schema(qwen_engines, name):
    plain, llm = qwen_engines["plain"], qwen_engines[name]
    schema = Constraint("json", json.dumps(SCHEMA))
    waves = [[(chat(plain, JSON_PROMPT), greedy(64, ignore_eos=False, structured=schema))]]
    want = baseline(qwen_engines, waves)[0]
    before = spec_counts(llm)
    (got,) = run(llm, waves).results
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")
    value = json.loads(got.text)
    assert set(value) == {"name", "version", "features", "license"}
    assert value["features"][2] == "speculative decoding"
    assert spec_counts(llm)[1] - before[1] > 5  # the constrained request did speculate


@pytest.mark.slow
def test_qwen_constrained_requests_with_and_without_drafts_share_a_step(qwen_engines):
    # Each draft row gets its own mask, and the masks stay with their rows.
    plain, llm = qwen_engines["plain"], qwen_engines["ngram"]
    schema = Constraint("json", json.dumps(SCHEMA))
    lines = Constraint("regex", r"(\d+\. [a-z]+\n){5}")
    json_prompt, list_prompt = chat(plain, JSON_PROMPT), chat(plain, LIST_PROMPT)
    waves = [
        [
            (json_prompt, greedy(64, ignore_eos=False, structured=schema)),
            (list_prompt, greedy(40, ignore_eos=False, structured=lines)),
            (json_prompt, greedy(64, ignore_eos=False, structured=schema, speculate=False)),
            (list_prompt, greedy(24)),
        ]
    ]
    want = baseline(qwen_engines, waves)
    got = run(llm, waves)
    ending = [(r.tokens, r.text, r.finish_reason) for r in want]
    assert [(r.tokens, r.text, r.finish_reason) for r in got.results] == ending
    for r in (got.results[0], got.results[2]):
        assert json.loads(r.text)["features"][2] == "speculative decoding"
    assert got.results[1].text == "1. apple\n2. banana\n3. cherry\n4. date\n5. elderberry\n"
    assert got.drafted["r0"] > 0 and got.drafted["r1"] > 0 and got.drafted["r2"] == 0


# -- interactions -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ngram", "other"])
def test_a_shared_prefix_is_served_from_the_cache_with_the_same_tokens(
    tiny_llama_dir, drafts, name
):
    system = random_prompt(37, VOCAB, seed=1)
    first = [
        (system + random_prompt(5 + i, VOCAB, seed=10 + i), greedy(20 + 3 * i)) for i in range(3)
    ]
    again = [(first[0][0] + random_prompt(9, VOCAB, seed=20), greedy(25)), (system, greedy(12))]
    waves = [first, again]
    # A small step budget: prompts come in chunks, and a draft model catches up on a whole
    # prompt in pieces.
    plain = run(make(tiny_llama_dir, enable_prefix_caching=False), waves)
    llm = make(tiny_llama_dir, drafts[name], max_num_batched_tokens=24)
    spec = run(llm, waves)
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]
    assert all(x.cached >= 32 for x in spec.results[3:])  # the second wave hit the cache
    drafted, _ = check_counts(llm, spec)
    assert drafted > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["ngram", "other", "self"])
def test_preempted_requests_give_the_same_tokens(tiny_llama_dir, drafts, name, mode):
    # 10 requests of up to ~70 tokens would hold up to 9 blocks of 8 each; the pool has 14.
    waves = [[(random_prompt(8 + 3 * i, VOCAB, seed=i), greedy(22 + 2 * i)) for i in range(10)]]
    kw = dict(num_kv_blocks=14, preemption_mode=mode, swap_space_gib=0.001)
    plain = run(make(tiny_llama_dir, **kw), waves)
    llm = make(tiny_llama_dir, drafts[name], **kw)
    spec = run(llm, waves)
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        swapped = llm.engine.metrics.swapped_blocks.labels("out")._value.get()
        assert swapped > 0
    drafted, _ = check_counts(llm, spec)
    assert drafted > 0


@pytest.mark.parametrize("policy", ["shift", "sink"])
@pytest.mark.parametrize("name", ["ngram", "other", "self"])
def test_context_overflow_during_speculation_gives_the_same_tokens(
    tiny_llama_dir, drafts, name, policy
):
    # max_model_len 48: each request overflows the context several times.
    waves = [[(random_prompt(20 + 5 * i, VOCAB, seed=i), greedy(90 + 7 * i)) for i in range(3)]]
    kw = dict(max_model_len=48, context_overflow=policy)
    plain = run(make(tiny_llama_dir, **kw), waves)
    llm = make(tiny_llama_dir, drafts[name], **kw)
    spec = run(llm, waves)
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]
    assert all(len(x.tokens) == 90 + 7 * i for i, x in enumerate(spec.results))
    overflows = llm.engine.metrics.context_overflows.labels(policy)._value.get()
    assert overflows >= 3 * 3
    drafted, _ = check_counts(llm, spec)
    assert drafted > 0


@pytest.mark.parametrize("name", ["ngram", "self", "other"])
def test_stop_tokens_and_max_tokens_end_where_they_do_without_speculation(
    tiny_llama_dir, drafts, name
):
    prompts = [random_prompt(20 + 4 * i, VOCAB, seed=30 + i) for i in range(4)]
    free = run(make(tiny_llama_dir), [[(p, greedy(40)) for p in prompts]]).results
    # Stop at a token produced mid-way through each unstopped output.
    stops = [b.tokens[12 + i] for i, b in enumerate(free)]
    requests = [(p, greedy(40, stop_token_ids=(t,))) for p, t in zip(prompts, stops)]
    requests += [(p, greedy(n)) for p, n in zip(prompts, [1, 2, 5, 13])]
    requests += [(prompts[0], greedy(40, stop_token_ids=(stops[0],), min_tokens=30))]
    waves = [requests]
    plain = run(make(tiny_llama_dir), waves)
    llm = make(tiny_llama_dir, drafts[name])
    spec = run(llm, waves)
    ending = [(r.tokens, r.finish_reason, r.stop_reason) for r in plain.results]
    assert [(r.tokens, r.finish_reason, r.stop_reason) for r in spec.results] == ending
    for i, r in enumerate(spec.results[:4]):
        assert r.finish_reason == "stop" and r.stop_reason == r.tokens[-1] == stops[i]
        assert r.tokens == free[i].tokens[: free[i].tokens.index(stops[i]) + 1]
    assert [len(r.tokens) for r in spec.results[4:8]] == [1, 2, 5, 13]
    assert len(spec.results[8].tokens) >= 30
    spec_counts(llm)
    assert sum(spec.drafted.values()) > 0


@pytest.mark.parametrize("name", ["ngram", "self", "other"])
def test_logprobs_are_those_of_decoding_without_speculation(tiny_llama_dir, drafts, name):
    waves = [[(p, greedy(q.max_tokens, logprobs=3)) for p, q in prompts_and_params(3)]]
    plain = run(make(tiny_llama_dir), waves)
    llm = make(tiny_llama_dir, drafts[name])
    spec = run(llm, waves)
    for g, w in zip(spec.results, plain.results):
        assert g.tokens == w.tokens and len(g.logprobs) == len(w.logprobs) == len(w.tokens)
        for a, b in zip(g.logprobs, w.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top] and len(a.top) == 3
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
    check_counts(llm, spec)


def test_penalized_greedy_requests_give_the_same_tokens(tiny_llama_dir, drafts):
    # Each verified row is penalized for the drafts before it, as it would be once they are out.
    params = [
        greedy(40, frequency_penalty=1.5),
        greedy(40, presence_penalty=2.0, repetition_penalty=1.5),
        greedy(40, logit_bias=((7, 3.0),), min_tokens=10, stop_token_ids=(7,)),
    ]
    prompts = [random_prompt(30, VOCAB, seed=40 + i) for i in range(3)]
    waves = [list(zip(prompts, params))]
    plain = run(make(tiny_llama_dir), waves)
    for name in ("self", "ngram"):
        llm = make(tiny_llama_dir, drafts[name])
        spec = run(llm, waves)
        assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results], name
        assert sum(spec.drafted.values()) > 0


@pytest.mark.parametrize("name", ["ngram", "other"])
def test_seeded_sampled_requests_are_reproducible_with_a_fixed_draft_length(
    tiny_llama_dir, drafts, name
):
    prompts = [random_prompt(20 + 3 * i, VOCAB, seed=50 + i) for i in range(4)]
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=100 + i) for i in range(4)]
    params[3] = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=103)
    waves = [list(zip(prompts, params))]
    first = run(make(tiny_llama_dir, drafts[name]), waves)
    second = run(make(tiny_llama_dir, drafts[name]), waves)
    assert [x.tokens for x in first.results] == [x.tokens for x in second.results]
    assert sum(first.drafted.values()) > 0
    # A seeded request's tokens do not depend on its batch either: alone it gets the same.
    alone = run(make(tiny_llama_dir, drafts[name]), [waves[0][1:2]])
    assert alone.results[0].tokens == first.results[1].tokens
    assert len({tuple(x.tokens) for x in first.results}) == 4


def test_seeded_sampled_requests_do_not_depend_on_the_chosen_draft_length(
    tiny_llama_dir, drafts, monkeypatch
):
    from engine.core.speculation import DraftLength

    prompt = random_prompt(24, VOCAB, seed=60)
    waves = [[(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=7))]]
    results = []
    for most in (2, 5):  # what two runs' step timings could make adaptive drafting choose
        monkeypatch.setattr(
            DraftLength, "choose", lambda self, acc, room, m=most: [min(m, r) for r in room]
        )
        results.append(run(make(tiny_llama_dir, drafts["self"], k=None), waves).results[0].tokens)
    assert results[0] == results[1]


def test_a_request_that_opts_out_drafts_nothing(tiny_llama_dir, drafts):
    prompt = random_prompt(30, VOCAB, seed=70)
    for name in ("ngram", "self"):
        llm = make(tiny_llama_dir, drafts[name])
        alone = run(llm, [[(prompt, greedy(30, speculate=False))]])
        assert spec_counts(llm)[0] == 0 and sum(alone.drafted.values()) == 0
        assert alone.sampled_rows == 30
        # beside a speculating request, only that one drafts
        both = run(llm, [[(prompt, greedy(30, speculate=False)), (prompt, greedy(30))]])
        assert both.drafted["r0"] == 0 and both.drafted["r1"] > 0
        assert spec_counts(llm)[0] == both.drafted["r1"]
        assert both.results[0].tokens == both.results[1].tokens == alone.results[0].tokens
    # Forced tokens are known already: nothing to draft.
    llm = make(tiny_llama_dir, drafts["self"])
    forced = run(llm, [[(prompt, SamplingParams(max_tokens=6, forced=prompt[:6], logprobs=1))]])
    assert forced.results[0].tokens == prompt[:6] and len(forced.results[0].logprobs) == 6
    assert sum(forced.drafted.values()) == 0


# -- settings ---------------------------------------------------------------------------------


def test_speculative_settings_are_checked_at_construction(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with pytest.raises(ValueError, match="speculative method"):
        EngineArgs(model=model, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="speculative-model"):
        EngineArgs(model=model, speculative_method="draft_model")
    with pytest.raises(ValueError, match="speculative-model"):
        EngineArgs(model=model, speculative_method="ngram", speculative_model=model)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineArgs(model=model, speculative_method="ngram", num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        EngineArgs(
            model=model, speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2
        )
    assert EngineArgs(model=model).speculative_config() is None
    implied = EngineArgs(model=model, speculative_model=model).speculative_config()
    assert implied.method == "draft_model" and implied.adaptive


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    save_tiny_llama(tmp_path / "big", vocab_size=2 * VOCAB)
    with pytest.raises(ValueError, match=rf"vocabulary \({2 * VOCAB} tokens\).*\({VOCAB}\)"):
        make(tiny_llama_dir, dict(speculative_model=str(tmp_path / "big")))


def test_a_draft_model_with_a_smaller_vocabulary_is_refused_or_works(tiny_llama_dir, drafts):
    # Prompt ids up to 127 against a draft of 96 tokens.
    waves = [prompts_and_params()]
    plain = run(make(tiny_llama_dir), waves)
    try:
        llm = make(tiny_llama_dir, drafts["small-vocab"])
    except ValueError as e:  # refused: fine, if it says why
        assert "vocabulary" in str(e)
        return
    spec = run(llm, waves)  # else no request may fail, and the tokens are the target's
    assert [x.tokens for x in spec.results] == [x.tokens for x in plain.results]


def test_a_draft_model_whose_cache_cannot_follow_the_targets_tables_is_refused(
    tiny_llama_dir, tmp_path
):
    save_tiny_gemma3(tmp_path / "gemma", vocab_size=VOCAB)  # a sliding-window group as well
    with pytest.raises(ValueError, match="KV-cache groups"):
        make(tmp_path / "gemma", dict(speculative_model=str(tiny_llama_dir)))
