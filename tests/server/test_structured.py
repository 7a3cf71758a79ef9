"""Structured outputs through the HTTP API with the real SmolLM2: every constrained answer
parses and validates (jsonschema is the oracle), streamed or not, greedy or sampled."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server.test_server import SERVED_NAME, real_server

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "good": {"type": "boolean"},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Describe a famous film as JSON."}]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    with real_server(smollm2_dir) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    import openai

    _, url = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate_streamed_or_not(client, name):
    schema = SCHEMAS[name]
    kwargs = dict(model=SERVED_NAME, messages=ASK, max_tokens=150,
                  response_format=response_format(schema))  # fmt: skip
    whole = client.chat.completions.create(**kwargs, temperature=0).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), schema)
    chunks = client.chat.completions.create(**kwargs, temperature=0.8, seed=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_llama_cpp_json_schema(client):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=ASK, max_tokens=150, temperature=0.7, seed=1,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS["enum"]
    r = client.completions.create(
        model=SERVED_NAME, prompt="A color and a count as JSON:", max_tokens=60, temperature=0,
        extra_body={"json_schema": schema},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_regex_choice_and_grammar_constraints_hold(client, temperature):
    def complete(prompt: str, constraint: dict, key: str = "structured_outputs") -> str:
        r = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=30, temperature=temperature, seed=5,
            extra_body={key: constraint},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    phone = complete("Call me at ", {"regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone)
    answer = complete("Is the sky green? Answer:", {"choice": ["yes", "no", "maybe"]})
    assert answer in ("yes", "no", "maybe")
    gbnf = 'root ::= "(" digit "+" digit ")"\ndigit ::= [0-9]'
    assert re.fullmatch(r"\([0-9]\+[0-9]\)", complete("Sum:", {"grammar": gbnf}))
    assert re.fullmatch(r"\([0-9]\+[0-9]\)", complete("Sum:", gbnf, key="grammar"))


def test_a_constrained_and_a_free_request_share_a_batch(client):
    """Side by side, each answer is what it is alone: the mask touches only its own row."""
    free = dict(model=SERVED_NAME, prompt="The history of Rome", max_tokens=40, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    schema = SCHEMAS["array"]
    bound = dict(model=SERVED_NAME, messages=ASK, max_tokens=80, temperature=0,
                 response_format=response_format(schema))  # fmt: skip
    alone_free = client.completions.create(**free).choices[0].text
    alone_bound = client.chat.completions.create(**bound).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        frees = [pool.submit(client.completions.create, **free) for _ in range(2)]
        bounds = [pool.submit(client.chat.completions.create, **bound) for _ in range(2)]
        assert [f.result().choices[0].text for f in frees] == [alone_free] * 2
        together = [b.result().choices[0].message.content for b in bounds]
    assert together == [alone_bound] * 2
    jsonschema.validate(json.loads(alone_bound), schema)
