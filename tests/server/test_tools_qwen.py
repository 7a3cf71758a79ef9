"""Tool calling on a real model whose chat template renders tools (Qwen2.5-Coder-0.5B-Instruct,
served from its GGUF file): the model's own Hermes ``<tool_call>`` output, unconstrained, comes
back as OpenAI tool calls, and a tool result goes back into its template."""

from __future__ import annotations

import json

import pytest

from tests.server.test_server import SERVED_NAME, real_server
from tests.server.test_structured import TOOLS, WEATHER_ASK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(qwen05_dir):
    with real_server(qwen05_dir) as pair:
        yield pair


def _ask(client, messages, **kwargs):
    return client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=80, **kwargs
    )


def test_the_model_calls_a_tool_and_answers_from_its_result(client):
    choice = _ask(client, WEATHER_ASK).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert not choice.message.content or "<tool_call>" not in choice.message.content

    turn = [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    answer = _ask(client, turn).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "18" in answer.message.content


def test_a_streamed_tool_call_equals_the_whole_one(client):
    whole = _ask(client, WEATHER_ASK).choices[0].message.tool_calls[0].function
    name, arguments, finish = None, "", None
    for chunk in _ask(client, WEATHER_ASK, stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert (name, json.loads(arguments)) == (whole.name, json.loads(whole.arguments))
