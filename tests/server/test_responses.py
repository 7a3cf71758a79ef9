"""The Responses API (/v1/responses) with the official openai client on real models: the chat
path is the oracle for its answers and token counts, jsonschema for its structured output, and
the client's own stream accumulator for the event sequence."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.test_server import CHAT, SERVED_NAME, real_server, tokenize
from tests.server.test_server_errors import StubEngine, assert_error
from tests.server.test_structured import ADD, SCHEMAS, TOOLS, WEATHER, WEATHER_ASK

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER,
                "description": "Current weather in a city", "strict": True}  # fmt: skip
ADD_TOOL = {"type": "function", "name": "add", "parameters": ADD, "strict": True}


def create(client, **kwargs):
    return client.responses.create(**({"model": SERVED_NAME, "temperature": 0} | kwargs))


def chat_answer(client, messages: list[dict], max_tokens: int) -> str:
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content


# ---- text ----


def test_a_plain_answer_is_the_chat_answer_with_its_usage(client, served):
    _, url = served
    r = create(client, input=ASK, max_output_tokens=24)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == SERVED_NAME
    assert r.status == "completed" and "Paris" in r.output_text
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text == chat_answer(client, CHAT, 24)
    assert r.usage.input_tokens == len(tokenize(url, messages=CHAT))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_are_a_system_message_and_items_are_messages(client, served):
    _, url = served
    instructions = "Answer in one short sentence."
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    r = create(client, instructions=instructions, input=items, max_output_tokens=16)
    messages = [{"role": "system", "content": instructions}, *CHAT]
    assert r.output_text == chat_answer(client, messages, 16)
    assert r.usage.input_tokens == len(tokenize(url, messages=messages))
    assert r.instructions == instructions


def test_max_output_tokens_cuts_the_answer_as_incomplete(client):
    r = create(client, input=ASK, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"


# ---- conversation state ----


def test_previous_response_id_continues_the_conversation_from_the_cache(client, served):
    _, url = served
    first = create(client, input=ASK, max_output_tokens=24)
    second = create(client, input="And of Germany?", previous_response_id=first.id,
                    max_output_tokens=24)  # fmt: skip
    history = [*CHAT, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And of Germany?"}]  # fmt: skip
    assert second.output_text == chat_answer(client, history, 24)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(tokenize(url, messages=history))
    # The first turn's prompt is a prefix of the second's: its full blocks come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_stored_responses_are_retrieved_and_deleted(client):
    r = create(client, input=ASK, max_output_tokens=4)
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text and again.usage == r.usage
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: create(client, input="Hi", previous_response_id=r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = create(client, input=ASK, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# ---- structured outputs and tools ----


def test_a_json_schema_answer_validates(client):
    schema = SCHEMAS["enum"]
    fmt = {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}
    r = create(client, input="A color and a count as JSON.", text={"format": fmt},
               max_output_tokens=60)  # fmt: skip
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_text_formats_become_the_chat_response_format():
    from server.responses import ResponsesRequest, chat_request, input_messages

    def response_format(fmt: dict) -> dict | None:
        req = ResponsesRequest.model_validate({"input": "Hi", "text": {"format": fmt}})
        given = chat_request(req, input_messages(req)).response_format
        return given.model_dump(by_alias=True, exclude_none=True) if given else None

    assert response_format({"type": "text"}) == {"type": "text"}
    assert response_format({"type": "json_object"}) == {"type": "json_object"}
    spec = {"type": "json_schema", "name": "n", "schema": ADD, "strict": True}
    assert response_format(spec) == {"type": "json_schema",
                                     "json_schema": {"name": "n", "schema": ADD}}  # fmt: skip


def test_a_named_function_call_is_an_item_that_matches_its_schema(client):
    choice = {"type": "function", "name": "add"}
    r = create(client, input="Add 2 and 3.", tools=[WEATHER_TOOL, ADD_TOOL], tool_choice=choice,
               max_output_tokens=60)  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)


# ---- streaming ----


def event_types(events) -> list[str]:
    """The types in order, runs of deltas collapsed to one."""
    out: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added",
                  "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]  # fmt: skip
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]  # fmt: skip
START = ["response.created", "response.in_progress"]


def test_a_stream_sends_the_documented_events_in_order(client):
    whole = create(client, input=ASK, max_output_tokens=24)
    events = list(create(client, input=ASK, max_output_tokens=24, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert event_types(events) == [*START, *MESSAGE_EVENTS, "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model=SERVED_NAME, input=ASK, temperature=0,
                                 max_output_tokens=24) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert stream.get_final_response().output_text == "".join(deltas) == text


def test_a_streamed_function_call_sends_its_arguments(client):
    choice = {"type": "function", "name": "add"}
    events = list(create(client, input="Add 2 and 3.", tools=[ADD_TOOL], tool_choice=choice,
                         max_output_tokens=60, stream=True))  # fmt: skip
    assert event_types(events) == [*START, *CALL_EVENTS, "response.completed"]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    jsonschema.validate(json.loads(arguments), ADD)
    assert events[-1].response.output[0].arguments == arguments


# ---- bad input ----

TOO_LONG = "hello " * 600
BAD = [
    ({"input": "Hi", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "Hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, 400,
     "tools.0.type"),
    ({"input": "Hi", "tools": [{"type": "computer_use_preview"}]}, 400, "tools.0.type"),
    ({"input": "Hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, 400, "temperature"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format"),
    ({"input": "Hi", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input.0.call_id"),
    ({"input": "Hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model"),
    ({"input": TOO_LONG}, 400, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_gets_an_openai_error(served, body, status, param):
    _, url = served
    assert_error(httpx.post(f"{url}/v1/responses", json=body), status, param)


def test_unknown_ids_are_404_and_the_client_raises_its_errors(client, served):
    _, url = served
    for method in ("GET", "DELETE"):
        error = assert_error(httpx.request(method, f"{url}/v1/responses/resp_none"), 404)
        assert error["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError, match="web_search"):
        create(client, input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        create(client, input=TOO_LONG)
    huge = json.dumps({"input": "x" * (4 << 20)})  # over the default --max-request-bytes
    r = httpx.post(
        f"{url}/v1/responses", content=huge, headers={"content-type": "application/json"}
    )
    assert_error(r, 413)


def test_responses_count_in_the_metrics(client, served):
    _, url = served

    def finished() -> float:
        lines = httpx.get(f"{url}/metrics").text.splitlines()
        return sum(float(ln.split()[-1]) for ln in lines
                   if ln.startswith("kvserve:request_success_total"))  # fmt: skip

    before = finished()
    create(client, input=ASK, max_output_tokens=2)
    assert finished() == before + 1


# ---- without a model ----


def test_an_api_key_guards_the_responses_routes():
    import asyncio

    from server.app import build_app
    from server.args import ServerArgs

    app = build_app(StubEngine(RuntimeError("unused")), ServerArgs(api_key=("k",)))
    transport = httpx.ASGITransport(app=app)

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as c:
            posted = await c.post("/v1/responses", json={"input": "Hi"})
            got = await c.get("/v1/responses/resp_x", headers={"Authorization": "Bearer k"})
            return [posted.status_code, got.status_code]

    assert asyncio.run(statuses()) == [401, 404]


class FailingMidStream(StubEngine):
    """Streams one piece of text, then fails the request."""

    def submit(self, requests):
        from engine.core.outputs import CompletionOutput, RequestOutput

        async def stream(rid: str):
            yield RequestOutput(rid, [1, 2, 3], [CompletionOutput(0, "Par", [7])])
            failed = CompletionOutput(0, "", [], finish_reason="error", error="a step failed")
            yield RequestOutput(rid, [1, 2, 3], [failed], finished=True)

        return [stream(r.request_id) for r in requests]


def test_a_failure_after_the_stream_began_is_its_last_event():
    import asyncio

    from server.app import build_app

    transport = httpx.ASGITransport(app=build_app(FailingMidStream(RuntimeError("unused"))))

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as c:
            return await c.post("/v1/responses", json={"input": "Hi", "stream": True})

    r = asyncio.run(post())
    assert r.status_code == 200
    lines = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    events = [json.loads(ln) for ln in lines]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert "a step failed" in events[-1]["message"]


class SlowEngine(StubEngine):
    """Answers "Paris" once ``release`` is set, so a response stays in flight until then."""

    def __init__(self):
        super().__init__(RuntimeError("unused"))
        self.release = None  # an asyncio.Event, made on the test's loop
        self.started = None

    def submit(self, requests):
        from engine.core.outputs import CompletionOutput, RequestOutput

        self.submitted += requests

        async def stream(rid: str):
            self.started.set()
            await self.release.wait()
            done = CompletionOutput(0, "Paris", [7], finish_reason="stop")
            yield RequestOutput(rid, [1, 2, 3], [done], finished=True)

        return [stream(r.request_id) for r in requests]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_deleted_in_flight_is_deleted_and_never_stored(stream):
    import asyncio

    from server.app import build_app

    engine = SlowEngine()
    transport = httpx.ASGITransport(app=build_app(engine))

    async def run() -> None:
        engine.release, engine.started = asyncio.Event(), asyncio.Event()
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as c:
            body = {"input": "Hi", "stream": stream}
            posted = asyncio.create_task(c.post("/v1/responses", json=body))
            await asyncio.wait_for(engine.started.wait(), 5)
            (request,) = engine.submitted
            rid = request.request_id.rsplit("-", 1)[0]  # the engine's id is the response's + "-0"
            deleted = await c.delete(f"/v1/responses/{rid}")
            assert deleted.status_code == 200, deleted.text
            assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
            engine.release.set()
            r = await posted
            assert r.status_code == 200 and rid in r.text  # the client still gets its answer
            assert (await c.get(f"/v1/responses/{rid}")).status_code == 404
            assert (await c.delete(f"/v1/responses/{rid}")).status_code == 404

            # Not deleted: stored when it ends.
            engine.release.clear()
            engine.started.clear()
            posted = asyncio.create_task(c.post("/v1/responses", json=body))
            await asyncio.wait_for(engine.started.wait(), 5)
            rid = engine.submitted[-1].request_id.rsplit("-", 1)[0]
            assert (await c.get(f"/v1/responses/{rid}")).status_code == 404  # nothing yet
            engine.release.set()
            assert (await posted).status_code == 200
            got = await c.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            assert got.json()["output"][0]["content"][0]["text"] == "Paris"

    asyncio.run(run())


def test_function_calls_and_their_outputs_become_one_assistant_turn_and_tool_messages():
    from server.responses import ResponsesRequest, input_messages

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "9 C"}]},
    ]})  # fmt: skip
    user, calls, out1, out2 = input_messages(req)
    assert (user.role, calls.role, calls.content) == ("user", "assistant", None)
    assert [c.id for c in calls.tool_calls] == ["c1", "c2"]
    assert (out1.role, out1.tool_call_id, out1.text) == ("tool", "c1", "18 C")
    assert (out2.tool_call_id, out2.text) == ("c2", "9 C")


# ---- a model whose template renders tools: the round trip ----

# test_tools_qwen's tools in this API's shape: the template renders the same prompt.
QWEN_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_function_tools_reach_the_template_as_the_chat_tools_do():
    from server.responses import ResponsesRequest, chat_request, input_messages

    choice = {"type": "function", "name": "add"}
    body = {"input": "Hi", "tools": QWEN_TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    req = ResponsesRequest.model_validate(body)
    chat = chat_request(req, input_messages(req))
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == TOOLS
    assert chat.tool_choice.function.name == "add" and chat.parallel_tool_calls is False


def test_a_bare_json_answer_naming_a_tool_is_its_call():
    from server.tools import ToolPlan

    plan = ToolPlan("hermes", None, None, names=("get_weather",))
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (call, f"```json\n{call}\n```\n"):
        content, (parsed,) = plan.parse(text)
        assert content is None and parsed.function.name == "get_weather"
        assert json.loads(parsed.function.arguments) == {"city": "Paris"}
    for text in ('{"name": "add", "arguments": {}}', call[:-1] + ', "x": 1}', "It is sunny."):
        assert plan.parse(text) == (text, [])


@pytest.fixture(scope="module")
def qwen(qwen05_dir):
    with real_server(qwen05_dir) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


def test_a_function_tool_round_trip_on_qwen(qwen):
    ask = dict(model=SERVED_NAME, tools=QWEN_TOOLS, temperature=0, max_output_tokens=40)
    first = qwen.responses.create(input=WEATHER_ASK[0]["content"], **ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temperature": 18, "sky": "sunny"}'}  # fmt: skip
    answer = qwen.responses.create(input=[result], previous_response_id=first.id, **ask)
    assert answer.output[0].type == "message" and "18" in answer.output_text
    # The first turn's prompt leads the second's: its full blocks come from the cache.
    cached = answer.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 16 * 16 > 0
