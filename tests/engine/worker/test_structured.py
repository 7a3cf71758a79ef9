"""Grammars: a constraint compiles once, at admission and under a time limit; the engine
thread copies it rather than compiling again; the compiled ones kept are bounded. What a
constraint cannot do is refused at admission when every output would meet it, else fails only
its own request while sampling."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core.errors import RequestError
from engine.core.sampling_params import Constraint, SamplingParams
from engine.worker import structured
from engine.worker.sampler import Sampler
from engine.worker.structured import CACHE_SIZE, Grammars


@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    g = Grammars(smollm2_dir / "tokenizer.json", 49152, (0,))
    g.tokenizer  # noqa: B018 - built once for the module (~0.3 s)
    return g


def small(i: int) -> Constraint:
    return Constraint("json", json.dumps({"type": "object", "properties": {f"k{i}": {}}}))


def test_thousands_of_distinct_schemas_keep_a_bounded_cache(grammars):
    for i in range(3000):
        grammars.grammar(small(i), 5.0)
        assert len(grammars._cache) <= CACHE_SIZE
    assert len(grammars._cache) == CACHE_SIZE
    assert not grammars._pending
    # The newest stay; the oldest compile again when they come back.
    assert (small(2999).kind, small(2999).value) in grammars._cache
    assert (small(0).kind, small(0).value) not in grammars._cache
    grammars.grammar(small(0), 5.0)
    assert (small(0).kind, small(0).value) in grammars._cache


def test_the_cache_is_bounded_by_text_size_too(grammars, monkeypatch):
    monkeypatch.setattr(structured, "CACHE_TEXT_BYTES", 2000)
    padded = [Constraint("json", json.dumps({"description": f"{i}" * 600})) for i in range(10)]
    for c in padded:
        grammars.grammar(c, 5.0)
        assert grammars._cache_bytes <= 2000
    assert (padded[-1].kind, padded[-1].value) in grammars._cache


def test_the_engine_thread_copies_the_admitted_grammar(grammars, monkeypatch):
    c = small(-1)
    compiled = grammars.grammar(c, 5.0)

    def no_second_compile(key):
        raise AssertionError("compiled on the engine thread again")

    monkeypatch.setattr(grammars, "_compile", no_second_compile)
    m = grammars.matcher("r1", c)
    assert m is not compiled and not m.is_error()
    assert m.consume_token(grammars.tokenizer.tokenize_str("{")[0])
    assert grammars.matcher("r2", c) is not m  # each request its own state
    grammars.forget(["r1", "r2"])


def test_an_invalid_schema_names_its_param(grammars):
    with pytest.raises(RequestError) as e:
        grammars.grammar(Constraint("json", '{"type": "nonsense"}', "response_format"), 5.0)
    assert e.value.param == "response_format" and e.value.code is None
    assert e.value.message.startswith("Invalid json:")


def test_a_compile_past_the_limit_is_refused_and_stays_refused(grammars):
    props = {f"s{i}": {"type": "string", "pattern": f"^[a-z]{{1,9}}x{i}$"} for i in range(3000)}
    c = Constraint("json", json.dumps({"type": "object", "properties": props}), "json_schema")
    for _ in range(2):  # waiting on the running compile, then finding it cached but slow
        with pytest.raises(RequestError) as e:
            grammars.grammar(c, 0.01)
        assert e.value.code == "grammar_too_complex" and e.value.param == "json_schema"
    assert grammars.grammar(c, 60.0) is not None  # a higher limit takes it, compiled once


# ---- what a constraint cannot do: refused at admission, or for its request alone ----

SMOL_VOCAB = 49152
EOS = 0  # the fixture's


def forced_walk(grammars, c: Constraint) -> tuple[str, int | None]:
    """The oracle for the forced start: a fresh llguidance matcher, each step's mask computed
    and its one allowed token taken by hand. (error or "", tokens until only EOS is allowed)."""
    import llguidance
    import llguidance.numpy

    m = llguidance.LLMatcher(
        grammars.tokenizer, llguidance.grammar_from(structured.FORMATS[c.kind], c.value)
    )
    row = llguidance.numpy.allocate_token_bitmask(1, SMOL_VOCAB)
    for n in range(20):
        llguidance.numpy.fill_next_token_bitmask(m, row, 0)
        if m.is_error():
            return m.get_error(), None
        allowed = structured.allowed_tokens(row[0], SMOL_VOCAB)
        if allowed == [EOS]:
            return "", n
        if len(allowed) > 1:
            return "", None
        if not m.consume_token(allowed[0]):
            return m.get_error(), None
    return "", None


@pytest.mark.parametrize(
    "c",
    [
        Constraint("json", json.dumps({"type": "string", "pattern": "^a{1000000}$"}), "schema"),
        Constraint("regex", "((ab){1000}c){1000}"),
    ],
    ids=["pattern", "regex"],
)
def test_a_lexer_past_its_limits_is_refused_at_admission(grammars, c):
    """llguidance compiles both; their lexer fails at the first token every output takes."""
    error, _ = forced_walk(grammars, c)
    assert "too many expressions" in error
    with pytest.raises(RequestError) as e:
        grammars.grammar(c, 60.0)
    assert e.value.param == c.param and "too many expressions" in e.value.message


def test_a_grammar_that_matches_nothing_is_refused_at_admission(grammars):
    c = Constraint("grammar", "start: start", "grammar")
    assert forced_walk(grammars, c)[0]
    with pytest.raises(RequestError) as e:
        grammars.grammar(c, 5.0)
    assert e.value.param == "grammar" and "no text matches it" in e.value.message


def test_min_tokens_past_the_end_of_a_forced_constraint_is_refused_at_admission(grammars):
    c = Constraint("json", json.dumps({"enum": ["a"]}), "json_schema")
    _, length = forced_walk(grammars, c)
    assert grammars.grammar(c, 5.0).length == length == 3  # '"', 'a', '"'
    grammars.admit(SamplingParams(max_tokens=8, min_tokens=length, structured=c), 5.0)
    too_many = SamplingParams(max_tokens=8, min_tokens=length + 1, structured=c)
    with pytest.raises(RequestError) as e:
        grammars.admit(too_many, 5.0)
    assert e.value.param == "min_tokens"
    # With ignore_eos min_tokens does not hold EOS back: the output goes on unconstrained.
    grammars.admit(SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, structured=c))
    # A constraint that branches from its first token is left to sampling.
    choice = Constraint("choice", json.dumps(["yes", "no"]))
    assert forced_walk(grammars, choice) == ("", None) and grammars.grammar(choice).length is None
    grammars.admit(SamplingParams(max_tokens=8, min_tokens=8, structured=choice))


def walked(grammars, rid: str, c: Constraint, text: str) -> list[int]:
    """The request's matcher advanced through ``text``; its tokens."""
    tokens = grammars.tokenizer.tokenize_str(text)
    m = grammars.matcher(rid, c)
    for t in tokens:
        assert m.consume_token(t)
    return tokens


def test_a_constraint_ended_before_min_tokens_fails_its_request_alone(grammars):
    """After "yes" the choice allows only EOS, which min_tokens holds back: that request gets
    a RequestError naming min_tokens; one that reached its min_tokens stops, and an
    unconstrained neighbour gets the token it gets alone."""
    c = Constraint("choice", json.dumps(["yes", "no"]))
    ids = ["short", "free", "done"]
    yes = [walked(grammars, rid, c, "yes") for rid in ("short", "done")][0]
    params = [
        SamplingParams(temperature=0, max_tokens=8, min_tokens=6, structured=c),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=len(yes), structured=c),
    ]
    outputs = [list(yes), [5, 6], list(yes)]
    logits = torch.randn(3, SMOL_VOCAB, generator=torch.Generator().manual_seed(0))
    s = Sampler(0, (EOS,), torch.device("cpu"), grammars)
    got = s.sample(logits, ids, params, [[1]] * 3, outputs, s.start_masks(ids, params))
    assert isinstance(got[0], RequestError) and got[0].param == "min_tokens", got[0]
    assert got[2] == (EOS, None)
    alone = Sampler(0, (EOS,), torch.device("cpu")).sample(
        logits[1:2], ["free"], params[1:2], [[1]], outputs[1:2]
    )
    assert got[1] == alone[0]
    grammars.forget(ids)


def test_a_draft_row_past_the_end_fails_only_if_the_drafts_before_it_stand(grammars):
    c = Constraint("choice", json.dumps(["yes", "no"]))
    p = SamplingParams(temperature=0, max_tokens=8, min_tokens=6, structured=c)
    (yes,), (no,) = grammars.tokenizer.tokenize_str("yes"), grammars.tokenizer.tokenize_str("no")
    s = Sampler(0, (EOS,), torch.device("cpu"), grammars)
    for preferred, fails in ((yes, True), (no, False)):
        logits = torch.zeros(2, SMOL_VOCAB)
        logits[0, preferred] = 10.0  # row 0 takes the draft "yes" or replaces it by "no"
        masks = s.start_masks(["r"], [p], [[yes]])
        (got,) = s.verify(logits, ["r"], [p], [[1]], [[]], [[yes]], masks)
        if fails:  # after "yes" the choice allows only EOS: min_tokens holds it back
            assert isinstance(got, RequestError) and got.param == "min_tokens", got
        else:
            assert [t for t, _ in got] == [no]
        s.forget(["r"])


def test_a_failed_matcher_fails_its_request_alone_and_is_compiled_afresh(grammars):
    c = Constraint("json", json.dumps({"type": "object"}), "response_format")
    grammars.grammar(c, 5.0)
    bad = grammars.matcher("bad", c)
    assert not bad.consume_token(grammars.tokenizer.tokenize_str("]")[0]) and bad.is_error()
    params = [SamplingParams(temperature=0, structured=c)] * 2
    s = Sampler(0, (EOS,), torch.device("cpu"), grammars)
    logits = torch.zeros(2, SMOL_VOCAB)
    got = s.sample(logits, ["bad", "good"], params, [[1]] * 2, [[], []],
                   s.start_masks(["bad", "good"], params))  # fmt: skip
    assert isinstance(got[0], RequestError) and got[0].param == "response_format"
    assert (c.kind, c.value) not in grammars._cache
    assert grammars.matcher("check", c).consume_token(got[1][0])
    s.forget(["bad", "good", "check"])
    assert not grammars.refused and not grammars.matchers
