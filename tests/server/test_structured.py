"""Structured outputs through the HTTP API with the real SmolLM2: every constrained answer
parses and validates (jsonschema is the oracle), streamed or not, greedy or sampled; a
constraint that cannot be met is a 400 naming its field, and fails no other request."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.server.test_server import SERVED_NAME

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


# ---- tools: tool_choice enforced by the same constraints ----

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "Current weather in a city"}},
    {"type": "function", "function": {"name": "add", "parameters": ADD,
                                      "description": "Add two integers"}},
]  # fmt: skip
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_calls(client, stream: bool = False, **kwargs) -> tuple[str, list[tuple[str, dict]]]:
    kwargs = dict(model=SERVED_NAME, messages=WEATHER_ASK, tools=TOOLS, max_tokens=120) | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = choice.message.tool_calls or []
        return choice.finish_reason, [(c.function.name, json.loads(c.function.arguments))
                                      for c in calls]  # fmt: skip
    calls, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert c.id.startswith("call_") and c.type == "function"
            calls.append((c.function.name, json.loads(c.function.arguments)))
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish, calls


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_named_tool_call_always_parses_and_matches_its_schema(client, seed):
    named = {"type": "function", "function": {"name": "add"}}
    temperature = 0 if seed is None else 1.0
    for stream in (False, True):
        finish, calls = tool_calls(client, stream, tool_choice=named, temperature=temperature,
                                   seed=seed)  # fmt: skip
        assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "add"
        jsonschema.validate(calls[0][1], ADD)


def test_required_and_auto_calls_name_a_tool_and_match_its_schema(client):
    for choice, parallel in (("required", True), ("required", False), ("auto", True)):
        finish, calls = tool_calls(client, tool_choice=choice, parallel_tool_calls=parallel,
                                   temperature=0.9, seed=1)  # fmt: skip
        assert finish == "tool_calls" and calls and (parallel or len(calls) == 1)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMA_OF[name])


def test_tool_none_answers_in_text_and_a_tool_result_is_rendered(client):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=WEATHER_ASK, tools=TOOLS, tool_choice="none",
        max_tokens=8, temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    history = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]  # fmt: skip
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=history, max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content


def test_hermes_tool_calls_are_parsed_from_the_models_own_format():
    from server.tools import ToolPlan

    plan = ToolPlan("hermes", None, None)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "C"}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "</tool_call>"
    )
    content, calls = plan.parse(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert plan.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_ignore_eos_goes_on_unconstrained_after_the_constraint_ends(client):
    r = client.completions.create(
        model=SERVED_NAME, prompt="Pick one:", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 12
    assert choice.text.startswith(("yes", "no"))


# ---- constraints that cannot be met: 400 naming the field, never a 500 ----

SAY = [{"role": "user", "content": "Say something."}]
UNMEETABLE = {
    # Every output is '"a"' (3 tokens): refused at admission.
    "enum ends before min_tokens": (
        "/v1/completions",
        {"prompt": "x", "json_schema": {"enum": ["a"]}, "max_tokens": 4, "min_tokens": 4},
        "min_tokens",
    ),
    # The choice branches, so sampling finds it: after "yes" or "no" only EOS is allowed.
    "choice ends before min_tokens": (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 6,
         "min_tokens": 6},
        "min_tokens",
    ),
    "pattern past the lexer's limits": (
        "/v1/chat/completions",
        {"messages": SAY, "max_tokens": 4, "response_format": {"type": "json_schema",
         "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "^a{1000000}$"}}}},
        "response_format",
    ),
    "regex past the lexer's limits": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "((ab){1000}c){1000}"}},
        "structured_outputs",
    ),
    "schema that is only its own ref": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4,
         "json_schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        "json_schema",
    ),
    "object that requires itself": (
        "/v1/chat/completions",
        {"messages": SAY, "max_tokens": 4, "response_format": {"type": "json_schema",
         "json_schema": {"name": "r", "schema": {"type": "object",
                         "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
        "response_format",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNMEETABLE))
def test_a_constraint_that_cannot_be_met_is_a_400_naming_its_field(served, name):
    _, url = served
    path, body, param = UNMEETABLE[name]
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_stream_whose_constraint_ends_before_min_tokens_ends_in_a_400_event(served):
    _, url = served
    _, body, _ = UNMEETABLE["choice ends before min_tokens"]
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["param"] == "min_tokens" and error["type"] == "invalid_request_error", error


def test_min_tokens_a_constraint_can_meet_is_served(client):
    r = client.completions.create(
        model=SERVED_NAME, prompt="x", max_tokens=8, temperature=0,
        extra_body={"json_schema": {"enum": ["a"]}, "min_tokens": 3},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].text) == "a"


def test_requests_failing_their_constraint_leave_their_batch_alone(served, client):
    """Side by side with requests that fail mid-generation, a free request's answer is the one
    it gets alone."""
    _, url = served
    free = dict(model=SERVED_NAME, prompt="The history of Rome", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    alone = client.completions.create(**free).choices[0].text
    _, failing, _ = UNMEETABLE["choice ends before min_tokens"]
    with ThreadPoolExecutor(4) as pool:
        frees = [pool.submit(client.completions.create, **free) for _ in range(2)]
        fails = [pool.submit(httpx.post, url + "/v1/completions", json=failing, timeout=60)
                 for _ in range(2)]  # fmt: skip
        assert [f.result().choices[0].text for f in frees] == [alone] * 2
        assert [f.result().status_code for f in fails] == [400, 400]
