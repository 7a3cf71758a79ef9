"""The Responses API's answer on the wire: output items, usage and the response object, in the
shapes of OpenAI's client (``openai.types.responses``)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.protocol import Usage


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int  # prompt tokens computed, their KV written to the cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        details = InputTokensDetails(
            cached_tokens=cached, cache_write_tokens=usage.prompt_tokens - cached
        )
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=details,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def deleted(response_id: str) -> str:
    return json.dumps({"id": response_id, "object": "response", "deleted": True})
