"""Tool calling: a request's tools and tool_choice become a constraint on the output (and, for
a chat template that cannot show tools, instructions in a system message); the output is
parsed back into OpenAI tool calls.

- ``tool_choice`` a named function: the output is that function's arguments, constrained to its
  parameters schema. ``"required"``: a JSON list of ``{"name", "parameters"}`` calls, each
  constrained to its function's schema (vLLM's format).
- ``"auto"`` with a template that renders tools: the model's own format, parsed when it is
  Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5/3, Hermes,
  SmolLM3 and others); text outside the tags is the content. An answer that is only
  ``{"name": <a tool>, "arguments": {...}}`` (bare or in a json fence) is a call too.
- ``"auto"`` with a template that does not: llama.cpp's generic format, constrained: the answer
  is ``{"tool_calls": [...]}`` or ``{"content": "..."}``.
- ``"none"``: no constraint, plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.core.errors import RequestError
from engine.core.sampling_params import Constraint
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# A whole answer that is one JSON object, bare or in a ```json fence: how small Hermes-style
# models (Qwen2.5-Coder) often write a call, without the tags (llama.cpp's parser takes it too).
BARE_CALL = re.compile(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # "named", "required", "hermes", "generic"
    constraint: Constraint | None
    instructions: str | None  # a system message for templates that cannot show tools
    function: str | None = None  # the named function
    names: tuple[str, ...] = ()  # the tools' names: a bare JSON answer naming one is a call

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, tool calls)."""
        if self.mode == "named":
            return None, [call(self.function, text)]
        if self.mode == "hermes":
            bodies = HERMES_CALL.findall(text)
            if not bodies:
                return self.bare_call(text)
            calls = []
            for body in bodies:
                try:
                    data = json.loads(body)
                    calls.append(call(data["name"], json.dumps(data.get("arguments", {}))))
                except (ValueError, KeyError, TypeError):
                    return text, []  # not a call after all: the text is the answer
            content = HERMES_CALL.sub("", text).strip()
            return content or None, calls
        data = json.loads(text)
        if self.mode == "generic":
            if "content" in data:
                return data["content"], []
            data = data["tool_calls"]
        return None, [call(c["name"], json.dumps(c["parameters"])) for c in data]

    def bare_call(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer as one call when it is ``{"name": <a tool>, "arguments": {...}}``."""
        match = BARE_CALL.fullmatch(text)
        try:
            data = json.loads(match[1]) if match else None
        except ValueError:
            data = None
        if (
            isinstance(data, dict)
            and data.get("name") in self.names
            and set(data) <= {"name", "arguments"}
            and isinstance(data.get("arguments", {}), dict)
        ):
            return None, [call(data["name"], json.dumps(data.get("arguments", {})))]
        return text.strip() or None, []


def call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
        name=name, arguments=arguments))  # fmt: skip


def plan(req: ChatCompletionRequest, template_takes_tools: bool) -> ToolPlan | None:
    """What the request's tools ask of the generation; None: nothing (plain content)."""
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise RequestError("tool_choice needs tools.", param="tool_choice")
    if choice == "none":
        return None
    if req.constraint() is not None:
        message = "tool_choice other than none cannot be combined with a response format."
        raise RequestError(message, param="tool_choice")
    instructions = None if template_takes_tools else describe(tools)
    if isinstance(choice, NamedToolChoice):
        fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if fn is None:
            message = f"tool_choice names `{choice.function.name}`, which is not in tools."
            raise RequestError(message, param="tool_choice")
        schema = json.dumps(fn.parameters or NO_ARGUMENTS)
        return ToolPlan("named", Constraint("json", schema, "tools"), instructions, fn.name)
    calls = calls_schema(tools, req.parallel_tool_calls)
    if choice == "required":
        return ToolPlan("required", Constraint("json", json.dumps(calls), "tools"), instructions)
    if template_takes_tools:
        return ToolPlan("hermes", None, None, names=tuple(t.function.name for t in tools))
    answer = {
        "anyOf": [
            {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
             "additionalProperties": False},
            {"type": "object", "properties": {"content": {"type": "string"}},
             "required": ["content"], "additionalProperties": False},
        ]
    }  # fmt: skip
    return ToolPlan("generic", Constraint("json", json.dumps(answer), "tools"), instructions)


def calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A non-empty JSON list of calls, each ``{"name", "parameters"}`` of one of ``tools``."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.parameters or NO_ARGUMENTS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def describe(tools: list[ToolDefinition]) -> str:
    """The tools, for a model whose template cannot show them."""
    specs = [t.function.model_dump(exclude_none=True) for t in tools]
    return (
        "You can call these tools (JSON schemas of their parameters):\n"
        + json.dumps(specs, indent=1)
        + '\nTo call tools, answer with JSON: {"tool_calls": [{"name": <tool name>, '
        '"parameters": <arguments>}]}.'
    )


def template_messages(
    messages: list[ChatMessage], tool_plan: ToolPlan | None, template_takes_tools: bool
) -> list[dict[str, Any]]:
    """The messages as the template gets them. A template that cannot show tools sees calls
    and results as JSON text, and the instructions in a system message."""
    out = [m.as_template_input() for m in messages]
    if template_takes_tools:
        return out
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            listed = [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]}
                      for c in calls]  # fmt: skip
            m["content"] = (m["content"] + "\n" if m["content"] else "") + json.dumps(
                {"tool_calls": listed}
            )
        if m["role"] == "tool":
            result = {"tool_call_id": m.pop("tool_call_id", None), "content": m["content"]}
            m.update(role="user", content=json.dumps({"tool_result": result}))
    if tool_plan is not None and tool_plan.instructions:
        if out[0]["role"] == "system":
            out[0]["content"] = tool_plan.instructions + "\n\n" + out[0]["content"]
        else:
            out.insert(0, {"role": "system", "content": tool_plan.instructions})
    return out
