"""Grammars: a constraint compiles once, at admission and under a time limit; the engine
thread copies it rather than compiling again; the compiled ones kept are bounded."""

from __future__ import annotations

import json

import pytest

from engine.core.errors import RequestError
from engine.core.sampling_params import Constraint
from engine.worker import structured
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
