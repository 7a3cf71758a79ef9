"""OpenAI-compatible request and response bodies, and their mapping onto SamplingParams."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.core.context_overflow import CONTEXT_POLICIES, ContextOverflow
from engine.core.errors import RequestError
from engine.core.sampling_params import INT64, Constraint, SamplingParams

# OpenAI fields we deliberately leave out. A request may still carry one when its value means
# "off" (clients often send the default explicitly); anything else is refused by name, so a
# caller never gets an answer that silently ignored what it asked for.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("function calling", ([],)),
    "function_call": ("function calling", ("none",)),
    "best_of": ("", (1,)),
    "suffix": ("", ("",)),
    "audio": ("audio output", ()),
    "modalities": ("only ['text']", (["text"],)),
    "prediction": ("predicted outputs", ()),
    "web_search_options": ("web search", ()),
    "reasoning_effort": ("", ()),
    # llama.cpp's prompt-progress chunks: the engine reports a request only once it has a
    # token, so there is no progress to tell before the first one.
    "return_progress": (
        "prompt-processing progress is not reported before the first token",
        (False,),
    ),
}
# Better words than pydantic's for the fields whose type is a union.
TYPE_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids, "
    "or a list of token id lists.",
    "stop": "stop must be a string or a list of strings.",
}

ANY_JSON_OBJECT = '{"type": "object"}'
MAX_N = 64
MAX_TOP_LOGPROBS = 20
# OpenAI's limit on a chat's messages. Checked as the body is validated, before the messages
# past it cost anything: validating 60,000 of them held the event loop for a second.
MAX_MESSAGES = 2048
# JSON has no -Infinity; masked-out alternatives get this instead, as vLLM does.
MIN_LOGPROB = -9999.0


def _normalize(cls: type[OpenAIBody], data: Any) -> Any:
    """Drops explicit nulls (OpenAI reads them as "default") and refuses the features the
    body's class leaves out (``unsupported``)."""
    if not isinstance(data, dict):
        return data
    data = {k: v for k, v in data.items() if v is not None}
    for name, (feature, harmless) in cls.unsupported.items():
        if name not in data:
            continue
        if not any(data[name] == value for value in harmless):
            detail = f" ({feature})" if feature else ""
            message = f"`{name}` is not supported by this server{detail}."
            raise PydanticCustomError("unsupported", message, {"param": name})
        del data[name]
    return data


def _check_unicode(data: Any) -> None:
    """Every string in a body must be valid Unicode: JSON can escape a lone surrogate
    ("\\ud800"), which no tokenizer or encoder accepts. Checked whole, in C, since this runs on
    the event loop before any field is validated (a walk in Python over 60,000 chat messages
    held it for a tenth of a second); only a body that fails is walked, to name the field."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError):  # a lone surrogate, or not JSON data
        _find_bad_unicode(data, "")


def _find_bad_unicode(data: Any, where: str) -> None:
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            message = f"{where or 'The body'} is not valid Unicode ({e.reason} at {e.start})."
            raise PydanticCustomError("invalid_unicode", message, {"param": where}) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            _find_bad_unicode(key, where)
            _find_bad_unicode(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _find_bad_unicode(value, f"{where}.{i}")


class OpenAIBody(BaseModel):
    """A request body: unknown fields are errors, so a typo is never silently ignored; no type
    is coerced (``"stream": "yes"`` is not a boolean) and numbers are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    # Fields refused by name unless their value means "off": feature, harmless values.
    unsupported: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = UNSUPPORTED

    _normalize = model_validator(mode="before")(classmethod(_normalize))


class RequestBody(OpenAIBody):
    """A whole request (not a part of one): its text is checked once, all of it."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class OverflowOptions(OpenAIBody):
    """kvserve extension: what to do when prompt + generation reach the model's context."""

    policy: Literal[CONTEXT_POLICIES] = Field(
        description="error: refuse prompt + max_tokens over the limit (400). truncate: drop the "
        "oldest prompt tokens after the first n_keep. stop: generate until the context is full, "
        "finish_reason 'length'. shift: when full, discard n_discard tokens after the first "
        "n_keep, re-rotate the cache and go on until max_tokens. sink: StreamingLLM, n_keep "
        "attention sinks plus the most recent window. snapkv, h2o, knorm: evict the cached "
        "tokens that matter least (by the attention the last window of queries or every query "
        "paid them, or by key norm), keeping n_keep first and window recent ones, when the "
        "context fills or the sequence exceeds kv_budget; kept tokens keep their positions."
    )
    n_keep: StrictInt | None = Field(
        None,
        description="Tokens kept at the start (-1: the whole prompt); for sink, the attention "
        "sinks. Default 4. shift and sink round it up to a KV block.",
    )
    n_discard: StrictInt | None = Field(
        None,
        description="Tokens discarded at each overflow, rounded up to a KV block. Default: "
        "half of what follows the kept tokens (shift), one block (sink).",
    )
    kv_budget: StrictInt | None = Field(
        None,
        description="snapkv, h2o, knorm: most tokens the sequence may cache (0: no budget). "
        "A longer prompt is compressed to it when its prefill ends. Default: the server's.",
    )
    window: StrictInt | None = Field(
        None, description="snapkv, h2o, knorm: recent tokens always kept (snapkv: its "
        "observation window). Default 64.",
    )  # fmt: skip
    selection: Literal["head", "layer"] | None = Field(
        None, description="snapkv, h2o, knorm: choose per KV head (default) or once per layer."
    )

    @model_validator(mode="after")
    def _check(self) -> OverflowOptions:
        try:
            self.to_engine()
        except RequestError as e:
            raise _field_error(e.param or "overflow", e.message) from None
        return self

    def to_engine(self) -> ContextOverflow:
        return ContextOverflow(
            self.policy, self.n_keep, self.n_discard, self.kv_budget, self.window, self.selection
        )


class JSONSchemaFormat(OpenAIBody):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBody):
    """OpenAI's: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            message = "response_format.json_schema is required with, and only with, json_schema."
            raise _field_error("response_format", message)
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json", ANY_JSON_OBJECT, "response_format")
        if self.type == "json_schema":
            return Constraint("json", json.dumps(self.json_schema.json_schema), "response_format")
        return None


class StructuredOutputs(OpenAIBody):
    """vLLM's structured_outputs: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> Constraint:
        given = [
            name
            for name in ("json_", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            message = "structured_outputs takes exactly one of json, regex, choice, grammar, " \
                "json_object."  # fmt: skip
            raise RequestError(message, param="structured_outputs")
        param = "structured_outputs"
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return Constraint("json", schema, param)
        if self.json_object:
            return Constraint("json", ANY_JSON_OBJECT, param)
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice), param)
        kind = given[0]
        return Constraint(kind, getattr(self, kind), param)


class SamplingFields(RequestBody):
    """Fields both generation endpoints share, OpenAI's and vLLM's extensions."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # metadata for the caller's own bookkeeping
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way
    safety_identifier: str | None = None
    service_tier: str | None = None  # one tier here
    prompt_cache_key: str | None = None  # prefix caching needs no hint
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM extensions
    top_k: StrictInt = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    prompt_logprobs: StrictInt | None = Field(
        None, description="Logprobs of the prompt's tokens with this many alternatives each."
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: StrictInt = Field(
        0, description="Lower runs first and is preempted last (vLLM's convention)."
    )
    # structured output: OpenAI's, vLLM's and llama.cpp's spellings (one of them at a time)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = Field(None, description="llama.cpp: a GBNF grammar.")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp: a JSON schema.")
    return_token_ids: bool = Field(
        False, description="vLLM: the prompt's and the completion's token ids in the answer."
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        None,
        description="vLLM: keep only this many prompt tokens (-1: max_model_len), dropped from "
        "the side truncation_side names.",
    )
    truncation_side: Literal["left", "right"] = Field(
        "left", description="left: keep the last truncate_prompt_tokens tokens; right: the first."
    )
    timings_per_token: bool = Field(
        False, description="llama.cpp: timings in every streamed chunk."
    )
    # kvserve extensions
    overflow: OverflowOptions | None = Field(
        None, description="Context-overflow policy for this request; default: the server's."
    )
    speculative: bool = Field(
        True,
        description="False: no speculative decoding for this request, where the server has it.",
    )

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingFields:
        if not 1 <= self.n <= MAX_N:
            raise _field_error("n", f"n must be between 1 and {MAX_N}, got {self.n}.")
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "stream_options is only allowed with stream.")
        keep = self.truncate_prompt_tokens
        if keep is not None and keep < 1 and keep != -1:
            message = f"truncate_prompt_tokens must be -1 or at least 1, got {keep}."
            raise _field_error("truncate_prompt_tokens", message)
        return self

    def prompt_budget(self, max_model_len: int) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (None: all); checked against the
        model before any prompt is tokenized."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            return max_model_len
        if keep is not None and keep > max_model_len:
            message = (
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({max_model_len}); give at most max_model_len, or -1."
            )
            raise RequestError(message, param="truncate_prompt_tokens")
        return keep

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        if keep is None or len(ids) <= keep:
            return ids
        return ids[-keep:] if self.truncation_side == "left" else ids[:keep]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise RequestError(
                    f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
                )
            out.append((int(key), bias))
        return tuple(out)

    def constraint(self) -> Constraint | None:
        """The request's structured-output constraint, from whichever field gave one."""
        found = []
        if self.response_format is not None and (given := self.response_format.constraint()):
            found.append(given)
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.constraint())
        if self.grammar is not None:
            found.append(Constraint("grammar", self.grammar, "grammar"))
        if self.json_schema is not None:
            found.append(Constraint("json", json.dumps(self.json_schema), "json_schema"))
        if len(found) > 1:
            message = "Give one of response_format, structured_outputs, grammar, json_schema."
            raise RequestError(message, param=found[1].param)
        return found[0] if found else None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        seed_offset: int = 0,
        prompt_logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> SamplingParams:
        """``constraint``: one that replaces the request's own (tool calling's)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else _wrap_int64(self.seed + seed_offset),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            overflow=self.overflow.to_engine() if self.overflow is not None else None,
            structured=constraint if constraint is not None else self.constraint(),
            speculate=self.speculative,
        )


def _wrap_int64(n: int) -> int:
    return (n - INT64[0]) % 2**64 + INT64[0]


def _field_error(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", message, {"param": param})


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic or FastAPI found in a body."""
    if not errors:
        return "Invalid request body.", None
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    ctx = err.get("ctx") or {}
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"Malformed JSON body: {ctx.get('error', err.get('msg'))}.", None
    if "param" in ctx:
        return err["msg"], ctx["param"]
    if not loc:
        if kind == "missing":
            return "A JSON object body is required.", None
        return "The request body must be a JSON object.", None
    field = ".".join(loc)
    if kind == "too_long" and "max_length" in ctx:  # OpenAI's words for an array over its limit
        return (
            f"Invalid '{field}': array too long. Expected an array with maximum length "
            f"{ctx['max_length']}, but got an array with length {ctx.get('actual_length')} "
            "instead.",
            field,
        )
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {field}", field
    if kind == "missing":
        return f"Missing required parameter: {field}.", field
    if loc[0] in TYPE_HINTS:
        return TYPE_HINTS[loc[0]], loc[0]
    return f"Invalid value for `{field}`: {err.get('msg')}.", field


TokenIds = list[StrictInt]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: bool = Field(
        False,
        description="Prepend the prompt to the text, and with logprobs its tokens' logprobs "
        "(the first token's are null). With max_tokens 0 the prompt alone is scored.",
    )

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if not self.prompt:
            raise _field_error("prompt", "prompt must not be empty.")
        if self.max_tokens == 0 and not self.echo:
            raise _field_error("max_tokens", "max_tokens may be 0 only with echo.")
        return self

    @property
    def scores_only(self) -> bool:
        """Echo with max_tokens 0: one token is generated and left out of the answer."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes: for echo and prompt_logprobs."""
        echoed = self.logprobs if self.echo else None
        wanted = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(wanted) if wanted else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class FunctionDefinition(OpenAIBody):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # every call is constrained to the schema either way


class ToolDefinition(OpenAIBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBody):
    name: str


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIBody):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    # Checked after the fields above (validators see the earlier fields only).
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any, info: ValidationInfo) -> Any:
        calls = info.data.get("role") == "assistant" and info.data.get("tool_calls")
        if content is None and not calls:
            message = "a message needs content (an assistant message may have tool_calls instead)"
            raise PydanticCustomError("missing_content", message)
        return content

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise _field_error("tool_calls", "Only assistant messages carry tool_calls.")
        return self

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return content or ""

    def as_template_input(self) -> dict[str, Any]:
        # Templates written for older models know no "developer" role; it means "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as templates expect them: parsed, unless they are not JSON."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise _field_error("top_logprobs", "top_logprobs requires logprobs to be true.")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                message = f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}."
                raise _field_error("top_logprobs", message)
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """None: up to the context limit, as OpenAI's chat endpoint does."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True  # for `prompt`; a chat template writes its own
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _field_error("prompt", "Give exactly one of `prompt` or `messages`.")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: TokenIds


# ---- responses ----


class ResponseBody(BaseModel):
    """A response whose extension fields (vLLM's, llama.cpp's) are left out, not null, when
    the request did not ask for them: an OpenAI answer stays OpenAI's shape."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids", "timings")

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class Timings(BaseModel):
    """llama.cpp's timings, as this server sees them: prompt_ms runs from admission to the
    first token (queueing included), predicted_ms from there to the last token."""

    cache_n: int  # prompt tokens whose KV came from the prefix cache
    prompt_n: int  # prompt tokens computed
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float

    @classmethod
    def of(
        cls, cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
    ) -> Timings:
        def per_token(ms: float, n: int) -> float:
            return ms / n if n else 0.0

        def per_second(ms: float, n: int) -> float:
            return 1000.0 * n / ms if ms > 0 else 0.0

        return cls(
            cache_n=cache_n,
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=per_token(prompt_ms, prompt_n),
            prompt_per_second=per_second(prompt_ms, prompt_n),
            predicted_n=predicted_n,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=per_token(predicted_ms, predicted_n),
            predicted_per_second=per_second(predicted_ms, predicted_n),
        )


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # null: an echoed first
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # prompt token
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: one per token, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(ResponseBody):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    timings: Timings | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(ResponseBody):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(ResponseBody):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    timings: Timings | None = None


class DeltaToolCall(ToolCall):
    index: int


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseBody):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's


class ChatCompletionChunk(ResponseBody):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # in the first chunk
    timings: Timings | None = None  # llama.cpp's timings_per_token


class VersionResponse(BaseModel):
    version: str


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info, the fields this server knows."""

    tokenizer_class: str
    model: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None = None
    bos_token_id: int | None = None
    eos_token: str | None = None
    eos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    chat_template: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
