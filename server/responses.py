"""OpenAI's Responses API (``/v1/responses``) as a translation onto the chat path.

A request becomes the chat request the chat endpoint serves (its template, tools, tool_choice,
structured outputs and sampling), with the stored conversation of ``previous_response_id``
ahead of this turn's input; the chat answer becomes Responses output items and usage.

- ``input``: a string, or items: messages (text parts only), ``function_call`` and
  ``function_call_output``. Consecutive calls, and the assistant text before them, are one
  assistant turn, as the model produced them, so a continued conversation renders its earlier
  turns as they were and the prefix cache finds them.
- ``instructions``: a system message ahead of everything, this turn only (as OpenAI: they are
  not carried over by ``previous_response_id``).
- Refused by name: reasoning, built-in tools (web search, file search, computer use, ...),
  non-text input, background mode, and the other fields below that would change the answer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, StrictInt, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from engine.core.errors import RequestError
from engine.core.sampling_params import INT64
from server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    OpenAIBody,
    RequestBody,
    ToolCall,
    Usage,
    describe_validation_error,
)
from server.response_types import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
    status_of,
)

RESPONSES_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "reasoning": ("", ()),
    "background": ("background mode", (False,)),
    "include": ("", ([],)),
    "conversation": ("conversation objects; use previous_response_id", ()),
    "prompt": ("prompt templates", ()),
    "max_tool_calls": ("", ()),
    "top_logprobs": ("", (0,)),
    "truncation": ("only 'disabled'", ("disabled",)),
    "context_management": ("", ()),
}
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_PART_TYPES = ("input_text", "output_text")
# Errors the chat path names by its own fields, renamed to this API's.
PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format"}  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _refuse(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message, {"param": param})


def _check_kinds(data: dict[str, Any]) -> None:
    """Names what the server does not serve: a built-in tool, an input item or part that is
    not text, before the typed models would only say that a tag did not match."""
    for i, tool in enumerate(data.get("tools") or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "function"):
            message = f"The built-in tool `{kind}` is not supported by this server; only " \
                "function tools are."  # fmt: skip
            raise _refuse(f"tools.{i}.type", message)
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        message = f"tool_choice `{choice.get('type')}` is not supported by this server."
        raise _refuse("tool_choice", message)
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in INPUT_ITEM_TYPES:
            message = f"Input items of type `{kind}` are not supported by this server."
            raise _refuse(f"input.{i}.type", message)
        parts = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, *TEXT_PART_TYPES):
                message = f"Only text input is supported by this server, not `{kind}`."
                raise _refuse(f"input.{i}.content.{j}.type", message)


# ---- the request ----


class TextPart(OpenAIBody):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # on output text handed back as input
    logprobs: list[Any] | None = None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class InputMessage(OpenAIBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class InputFunctionCall(OpenAIBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class InputFunctionOutput(OpenAIBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


InputItem = InputMessage | InputFunctionCall | InputFunctionOutput
ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionOutput,
}


def _parse_items(items: Any) -> Any:
    """Each item by the model its ``type`` names (a message may leave it out), its errors
    named by their place in ``input``: a tagged union would put the tag in the path."""
    if not isinstance(items, list):
        return items
    parsed = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        try:
            parsed.append(ITEM_MODELS[kind].model_validate(item) if kind else item)
        except ValidationError as e:
            errors = [{**err, "loc": ("input", i, *err["loc"])} for err in e.errors()]
            message, param = describe_validation_error(errors)
            raise PydanticCustomError("invalid_field", message, {"param": param}) from None
    return parsed


class FunctionTool(OpenAIBody):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # a constrained call matches its schema either way

    def for_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(OpenAIBody):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.json_schema is None:
            raise RequestError("text.format.schema is required with json_schema.", "text.format")
        spec = {"name": self.name or "answer", "schema": self.json_schema}
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(OpenAIBody):
    unsupported: ClassVar = {"verbosity": ("", ("medium",))}

    format: TextFormat | None = None


class ResponsesStreamOptions(OpenAIBody):
    include_obfuscation: bool = True  # nothing here is obfuscated either way


class ResponsesRequest(RequestBody):
    unsupported: ClassVar = RESPONSES_UNSUPPORTED

    model: str | None = None
    input: Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no hint
    # Extensions, as on the chat endpoint.
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: str | list[str] | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _input_items(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_kinds(data)
            items = data.get("input")
            if isinstance(items, str):
                items = [{"role": "user", "content": items}]
            data = {**data, "input": _parse_items(items)} if "input" in data else data
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "stream_options is only allowed with stream.")
        return self


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """This turn's input items as chat messages (without the instructions)."""
    out: list[ChatMessage] = []
    for item in req.input:
        if isinstance(item, InputFunctionCall):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                            arguments=item.arguments))  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, InputFunctionOutput):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output)))  # fmt: skip
        else:
            out.append(ChatMessage(role=item.role, content=_text(item.content)))
    return out


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that answers ``req``, over the whole conversation ``messages``."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stop": req.stop,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [t.for_chat() for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        body["tool_choice"] = req.tool_choice
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.for_chat()
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})  # fmt: skip
    except ValidationError as e:
        message, param = describe_validation_error(list(e.errors()))
        raise RequestError(message, param=PARAM_NAMES.get(param, param)) from None


# ---- one turn: the request in, the response out ----


@dataclass
class ResponseTurn:
    """One request's turn: the conversation before it, its own input and what it was asked."""

    req: ResponsesRequest
    model: str
    history: list[ChatMessage]  # the stored conversation of previous_response_id
    inputs: list[ChatMessage] = field(init=False)
    chat: ChatCompletionRequest = field(init=False)
    id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.inputs = input_messages(self.req)
        messages = [*self.history, *self.inputs]
        if self.req.instructions is not None:
            messages.insert(0, ChatMessage(role="system", content=self.req.instructions))
        self.chat = chat_request(self.req, messages)

    def response(
        self, status: str, output: list[OutputItem] = (), usage: Usage | None = None
    ) -> ResponseObject:
        req = self.req
        text_format = req.text.format if req.text is not None and req.text.format else None
        tool_choice = req.tool_choice or ("auto" if req.tools else "none")
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=self.model,
            output=list(output),
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            store=req.store,
            temperature=1.0 if req.temperature is None else req.temperature,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True)
                  if text_format else {"type": "text"}},
            tool_choice=tool_choice.model_dump() if isinstance(tool_choice, BaseModel)
            else tool_choice,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
            top_p=1.0 if req.top_p is None else req.top_p,
            usage=ResponseUsage.of(usage) if usage is not None else None,
            user=req.user,
            metadata=req.metadata or {},
        )  # fmt: skip

    def output(self, answer: AssistantMessage, finish_reason: str | None) -> list[OutputItem]:
        """The answer's items: its text as a message (always one without calls), then a
        ``function_call`` per tool call."""
        status = status_of(finish_reason)
        items: list[OutputItem] = []
        if answer.content or not answer.tool_calls:
            text = OutputText(text=answer.content or "")
            items.append(OutputMessage(id=self.message_id, status=status, content=[text]))
        for c in answer.tool_calls:
            items.append(OutputFunctionCall(id=new_id("fc"), call_id=c.id, name=c.function.name,
                                            arguments=c.function.arguments))  # fmt: skip
        return items

    def conversation(self, answer: AssistantMessage) -> list[ChatMessage]:
        """What a continuation starts from: every turn so far and this one's answer."""
        reply = ChatMessage(role="assistant", content=answer.content,
                            tool_calls=answer.tool_calls or None)  # fmt: skip
        return [*self.history, *self.inputs, reply]
