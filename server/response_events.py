"""The typed server-sent events of a streamed ``/v1/responses`` answer, in OpenAI's order:

```
response.created, response.in_progress
  per output item:  response.output_item.added
    a message:        response.content_part.added, response.output_text.delta ...,
                      response.output_text.done, response.content_part.done
    a function call:  response.function_call_arguments.delta, .._arguments.done
                    response.output_item.done
response.completed (or response.incomplete when max_output_tokens cut it short)
```

Every event is ``event: <type>`` plus its JSON with ``type`` and a ``sequence_number`` counting
from 0; there is no ``[DONE]``. A failure after the stream began is one ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from engine.core.errors import RequestError
from server.response_types import OutputFunctionCall, OutputItem, OutputMessage, ResponseObject


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


class ResponseEvents:
    """Numbers and formats one stream's events."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence}
        data.update((k, _plain(v)) for k, v in fields.items())
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def started(self, response: ResponseObject) -> list[str]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def finished(self, response: ResponseObject) -> str:
        """response.completed, or response.incomplete when max_output_tokens cut it short."""
        return self.event(f"response.{response.status}", response=response)

    def message_started(self, index: int, message: OutputMessage) -> list[str]:
        started = message.model_copy(update={"status": "in_progress", "content": []})
        return [
            self.event("response.output_item.added", output_index=index, item=started),
            self.event("response.content_part.added", item_id=message.id, output_index=index,
                       content_index=0, part={"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []}),
        ]  # fmt: skip

    def text_delta(self, index: int, item_id: str, delta: str) -> str:
        return self.event("response.output_text.delta", item_id=item_id, output_index=index,
                          content_index=0, delta=delta, logprobs=[])  # fmt: skip

    def message_done(self, index: int, message: OutputMessage) -> list[str]:
        part = message.content[0]
        where = {"item_id": message.id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=part.text, logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=message),
        ]

    def function_call(self, index: int, call: OutputFunctionCall) -> list[str]:
        started = call.model_copy(update={"status": "in_progress", "arguments": ""})
        where = {"item_id": call.id, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=started),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),  # fmt: skip
            self.event("response.output_item.done", output_index=index, item=call),
        ]

    def items(self, items: list[OutputItem], start: int = 0) -> list[str]:
        """Whole items, each as its full run of events (a message's text as one delta)."""
        out: list[str] = []
        for index, item in enumerate(items, start):
            if isinstance(item, OutputFunctionCall):
                out += self.function_call(index, item)
                continue
            out += self.message_started(index, item)
            if item.content[0].text:
                out.append(self.text_delta(index, item.id, item.content[0].text))
            out += self.message_done(index, item)
        return out

    def error(self, exc: Exception) -> str:
        if isinstance(exc, RequestError):
            return self.event("error", code=exc.code, message=exc.message, param=exc.param)
        message = f"Internal server error: {type(exc).__name__}: {exc}"
        return self.event("error", code="internal_server_error", message=message, param=None)
