"""The OpenAI-compatible HTTP API over an AsyncEngine."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineRequest
from engine.core.errors import QueueFullError, RequestError
from engine.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.core.sampling_params import SamplingParams
from models.tokenizer import TooManyTokens
from server.args import ServerArgs
from server.guard import Guard
from server.protocol import (
    MIN_LOGPROB,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    Timings,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    ToolDefinition,
    TopLogprob,
    Usage,
    VersionResponse,
    describe_validation_error,
    random_id,
)
from server.response_events import ResponseEvents
from server.response_store import ResponseNotFoundError, ResponseStore, StoredResponse
from server.response_types import OutputMessage, ResponseObject, deleted, status_of
from server.responses import PARAM_NAMES, ResponsesRequest, ResponseTurn
from server.tools import ToolPlan, template_messages
from server.tools import plan as plan_tools

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.server")

# How often a non-streaming request looks for its client having gone away.
DISCONNECT_POLL_S = 0.25


class ModelNotFoundError(RequestError):
    status = 404

    def __init__(self, model: str):
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class ShuttingDownError(RequestError):
    """The server stopped a request it could not finish within its drain deadline."""

    status = 503
    type = "server_error"

    def __init__(self):
        super().__init__(
            "The server is shutting down and could not finish this request in time.",
            code="shutting_down",
        )


class EngineFailedError(Exception):
    """The engine failed one choice; its message is the engine's."""


class ClientGoneError(Exception):
    """The client closed the connection before its answer was ready."""


# ---- one generation: n engine requests merged into one stream of choices ----


@dataclass
class ChoiceState:
    """A choice as accumulated so far from the engine's deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    fault: RequestError | None = None  # the request's own, when it failed by it
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error
            self.fault = delta.fault


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave async iterators as (which, item), in arrival order."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    done = object()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class Generation:
    """The engine requests behind one HTTP request, and the choices they build (choice i is
    request i). While it runs it is a member of ``active``."""

    def __init__(self, engine: AsyncEngine, requests: list[EngineRequest], active: set):
        self.engine = engine
        self.requests = requests
        self.choices = {i: ChoiceState(i) for i in range(len(requests))}
        self.cached = [0] * len(requests)  # prompt tokens each request found in the cache
        # For llama.cpp's timings: when the engine took the requests, and when the first and
        # the latest tokens (of any choice) came back.
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._stream = merge_streams(engine.submit(requests))
        self._first: tuple[int, RequestOutput] | None = None
        self._active = active
        active.add(self)

    async def start(self) -> None:
        """Waits for the first output, so that a refused request fails before any byte is sent."""
        try:
            self._first = await anext(self._stream)
        except StopAsyncIteration:
            pass
        except BaseException:
            self._active.discard(self)
            self.abort_unfinished()
            await self._stream.aclose()
            raise

    async def deltas(self) -> AsyncIterator[tuple[ChoiceState, CompletionOutput]]:
        try:
            if self._first is not None:
                yield self._apply(*self._first)
                self._first = None
            async for which, out in self._stream:
                yield self._apply(which, out)
        finally:
            self._active.discard(self)
            self.abort_unfinished()
            await self._stream.aclose()

    def _apply(self, which: int, out: RequestOutput) -> tuple[ChoiceState, CompletionOutput]:
        choice = self.choices[which]
        self.cached[which] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        delta = out.outputs[0]
        if delta.token_ids:
            self.last_token = time.monotonic()
            self.first_token = self.first_token or self.last_token
        choice.add(delta)
        return choice, delta

    def unfinished(self) -> list[str]:
        return [
            r.request_id
            for i, r in enumerate(self.requests)
            if self.choices[i].finish_reason is None
        ]

    def abort_unfinished(self) -> None:
        # Synchronous on purpose: it frees the blocks even when the task closing the streams
        # is itself being cancelled and cannot await their cleanup.
        for rid in self.unfinished():
            self.engine.abort(rid)

    def fail(self, error: BaseException) -> None:
        """Ends every unfinished choice with ``error`` now, even while the engine is stuck."""
        self._active.discard(self)
        for rid in self.unfinished():
            self.engine.fail(rid, error)

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def usage(self, prompt_tokens: int, n: int, scores_only: bool = False) -> Usage:
        """Usage of prompts counted once each (``n`` requests, one per choice, per prompt);
        ``scores_only``: the generated tokens are not part of the answer."""
        cached = sum(self.cached[::n])
        return Usage.of(prompt_tokens, 0 if scores_only else self.completion_tokens(), cached)

    def timings(self, prompt_tokens: int, n: int, scores_only: bool = False) -> Timings:
        """llama.cpp's timings for the whole request so far (all its prompts and choices)."""
        usage = self.usage(prompt_tokens, n, scores_only)
        cached = usage.prompt_tokens_details.cached_tokens
        first = self.first_token or time.monotonic()
        last = self.last_token or first
        return Timings.of(
            cache_n=cached,
            prompt_n=usage.prompt_tokens - cached,
            prompt_ms=(first - self.started) * 1000.0,
            predicted_n=usage.completion_tokens,
            predicted_ms=(last - first) * 1000.0,
        )


def check_finished(choice: ChoiceState) -> None:
    if choice.finish_reason == "error":
        raise failure(choice)


def failure(choice: ChoiceState) -> Exception:
    """Why a choice ended in an error: the request's fault (a 4xx), or the engine's (a 500)."""
    if choice.fault is not None:
        return choice.fault
    message = choice.error or "unknown error"
    return EngineFailedError(f"The engine failed choice {choice.index}: {message}")


@dataclass
class Echo:
    """What each completion choice starts with under ``echo``: its prompt's text and, with
    logprobs, its prompt tokens' logprobs (choice i answers prompt i // n)."""

    server: OpenAIServer
    req: CompletionRequest
    prompts: list[list[int]]

    def text(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[index // self.req.n]
        if isinstance(prompt, str) and self.req.truncate_prompt_tokens is None:
            return prompt
        # Token ids, or a truncated prompt: what the model saw.
        ids = self.prompts[index // self.req.n]
        tok = self.server.engine.tokenizer
        return tok.decode(ids, self.req.skip_special_tokens) if tok is not None else ""

    def logprobs(
        self, choice: ChoiceState, generated: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        """The prompt's logprobs followed by ``generated`` (offsets already past the prompt)."""
        if not self.req.echo or self.req.logprobs is None:
            return generated
        ids = self.prompts[choice.index // self.req.n]
        out = self.server.completion_logprobs(choice.prompt_logprobs, self.req.logprobs, 0, ids)
        if generated is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(out, name).extend(getattr(generated, name))
        return out


# ---- the server ----


class OpenAIServer:
    def __init__(
        self, engine: AsyncEngine, args: ServerArgs, extra_model_names: Iterable[str] = ()
    ):
        self.engine = engine
        self.args = args
        self.served_model_name = args.served_model_name or engine.model_name
        self.model_names = {self.served_model_name, engine.model_name, *extra_model_names}
        self.active: set[Generation] = set()  # generations in flight
        self.draining = False  # set at shutdown: new requests get 503
        self.response_store = ResponseStore(
            args.response_store_max_entries, args.response_store_max_bytes
        )

    def liveness(self) -> str | None:
        """None while this server is alive (its engine thread runs and comes back from its
        steps), draining included; else why a restart is due."""
        return self.engine.liveness(self.args.engine_hang_timeout)

    def readiness(self) -> str | None:
        """None when this server should get new traffic; else why not: it drains, its engine
        is not live, or its engine has made no progress for --engine-stall-timeout."""
        if self.draining:
            return "the server is shutting down"
        return self.engine.readiness(self.args.engine_stall_timeout, self.args.engine_hang_timeout)

    def abort_all(self, error: BaseException) -> int:
        """Ends every generation in flight with ``error``; returns how many there were."""
        active = list(self.active)
        for gen in active:
            gen.fail(error)
        return len(active)

    def admit(self, num_prompts: int, n: int) -> None:
        """Refuses, before any work, a request over the per-request limits (400) or one the
        queue has no room for (429)."""
        limit = self.args.max_prompts_per_request
        if num_prompts > limit:
            message = f"A request may batch at most {limit} prompts; got {num_prompts}."
            raise RequestError(message, param="prompt", code="too_many_prompts")
        limit = self.args.max_sequences_per_request
        if num_prompts * n > limit:
            message = (
                f"A request may start at most {limit} sequences (prompts x n); got "
                f"{num_prompts} x {n} = {num_prompts * n}."
            )
            raise RequestError(message, param="n", code="too_many_sequences")
        self.engine.check_admission(num_prompts * n)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(model)

    # -- prompts --

    def tokenizer(self, param: str) -> Tokenizer:
        tok = self.engine.tokenizer
        if tok is None:
            message = "This model has no tokenizer; send prompts as token ids."
            raise RequestError(message, param=param)
        return tok

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[ToolDefinition] | None = None,
        tool_plan: ToolPlan | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The chat's prompt ids; past ``max_tokens``, TooManyTokens (``Tokenizer.encode``)."""
        tok = self.tokenizer("messages")
        if not tok.has_chat_template:
            message = "This model has no chat template; use /v1/completions."
            raise RequestError(message, param="messages")
        takes_tools = tok.template_takes_tools
        rendered = template_messages(messages, tool_plan, takes_tools)
        specs = [t.model_dump(exclude_none=True) for t in tools] if tools and takes_tools else None
        try:
            return tok.encode_chat(rendered, add_generation_prompt, specs, max_tokens=max_tokens)
        except ValueError as e:  # the template's own checks, e.g. roles out of order
            raise RequestError(str(e), param="messages") from e

    def text_prompt(
        self,
        prompt: str | list[int],
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The prompt's ids; past ``max_tokens``, TooManyTokens (``Tokenizer.encode``)."""
        if not isinstance(prompt, str):
            return list(prompt)
        try:
            return self.tokenizer("prompt").encode(prompt, add_special_tokens, max_tokens)
        except ValueError as e:  # not valid Unicode
            raise RequestError(f"The prompt cannot be tokenized: {e}.", param="prompt") from e

    async def text_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Tokenized in a worker thread: a long text never holds up the event loop."""
        if all(not isinstance(p, str) for p in prompts):
            return [list(p) for p in prompts]
        return await asyncio.to_thread(lambda: [self.text_prompt(p) for p in prompts])

    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        return tok.token_str(token_id) if tok is not None else f"token_id:{token_id}"

    # -- generation --

    async def generation(
        self, rid: str, prompts: list[list[int]], params: list[SamplingParams], priority: int
    ) -> Generation:
        """n = len(params) choices per prompt, admitted as one group."""
        requests = []
        for ids in prompts:
            # The choices differ only in their seeds. A constraint compiles at admission, for up
            # to --max-grammar-compile-s: in a worker thread, so other streams go on meanwhile.
            if params[0].structured is not None:
                admitted = await asyncio.to_thread(self.engine.admit, ids, params[0])
            else:
                admitted = self.engine.admit(ids, params[0])
            for choice_params in params:
                rid_k = f"{rid}-{len(requests)}"
                requests.append(EngineRequest(rid_k, admitted.for_choice(choice_params), priority))
        gen = Generation(self.engine, requests, self.active)
        await gen.start()
        return gen

    async def collect(self, gen: Generation, request: Request) -> list[ChoiceState]:
        """Runs a generation to its end, aborting it if the client goes away meanwhile."""

        async def drain() -> None:
            async for _ in gen.deltas():
                pass

        async def client_gone() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        work = asyncio.create_task(drain())
        watch = asyncio.create_task(client_gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                gen.abort_unfinished()
                work.cancel()
                await asyncio.wait({work})
        if work.cancelled():
            raise ClientGoneError()
        work.result()
        choices = [gen.choices[i] for i in sorted(gen.choices)]
        for choice in choices:
            check_finished(choice)
        return choices

    # -- /v1/completions --

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        rid = random_id("cmpl")
        max_tokens = 1 if req.scores_only else req.max_tokens
        plp = req.engine_prompt_logprobs
        params = [req.sampling_params(max_tokens, req.logprobs, k, plp) for k in range(req.n)]
        self.admit(len(req.prompts), req.n)
        keep = req.prompt_budget(self.engine.max_model_len)
        prompts = [req.truncate(ids, keep) for ids in await self.text_prompts(req.prompts)]
        gen = await self.generation(rid, prompts, params, req.priority)
        echo = Echo(self, req, prompts)
        usage_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            return sse_response(self.completion_events(rid, gen, req, usage_prompt, echo))
        choices = await self.collect(gen, request)
        body = []
        for c in choices:
            text, entries = ("", []) if req.scores_only else (c.text, c.logprobs)
            prefix = echo.text(c.index)
            logprobs = self.completion_logprobs(entries, req.logprobs, len(prefix))
            body.append(
                CompletionChoice(
                    index=c.index,
                    text=prefix + text,
                    logprobs=echo.logprobs(c, logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(c.prompt_logprobs, req.prompt_logprobs),
                    **token_id_fields(
                        req, prompts[c.index // req.n], [] if req.scores_only else c.token_ids
                    ),
                )
            )
        usage = gen.usage(usage_prompt, req.n, req.scores_only)
        timings = gen.timings(usage_prompt, req.n, req.scores_only)
        return json_response(
            CompletionResponse(
                id=rid, model=self.served_model_name, choices=body, usage=usage, timings=timings
            )
        )

    async def completion_events(
        self, rid: str, gen: Generation, req: CompletionRequest, usage_prompt: int, echo: Echo
    ) -> AsyncIterator[str]:
        created = int(time.time())
        offsets = dict.fromkeys(gen.choices, 0)
        first = set(gen.choices)  # choices that have not sent a chunk yet
        sent = dict.fromkeys(gen.choices, 0)  # token ids each choice has sent

        def usage() -> Usage:
            return gen.usage(usage_prompt, req.n, req.scores_only)

        def timings() -> Timings | None:
            return gen.timings(usage_prompt, req.n, req.scores_only)

        async for choice, delta in gen.deltas():
            if delta.finish_reason == "error":
                yield sse_error(failure(choice))
                yield "data: [DONE]\n\n"
                return
            text, entries = ("", None) if req.scores_only else (delta.text, delta.logprobs)
            index = choice.index
            prefix = echo.text(index) if index in first else ""
            logprobs = self.completion_logprobs(entries, req.logprobs, offsets[index] + len(prefix))
            if index in first:
                logprobs = echo.logprobs(choice, logprobs)
            if logprobs is not None:
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            plp = None
            if index in first:
                plp = self.prompt_logprobs(choice.prompt_logprobs, req.prompt_logprobs)
            # Ids of tokens that made no text yet (a split character) go with a later chunk.
            ids = [] if req.scores_only else choice.token_ids[sent[index] :]
            prompt_ids = echo.prompts[index // req.n] if index in first else None
            if not (prefix or text or delta.finish_reason or logprobs or plp):
                continue
            sent[index] += len(ids)
            chunk = CompletionResponse(
                id=rid,
                created=created,
                model=self.served_model_name,
                choices=[
                    CompletionChoice(
                        index=index,
                        text=prefix + text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                        prompt_logprobs=plp,
                        **token_id_fields(req, prompt_ids, ids),
                    )
                ],
                usage=usage() if req.continuous_usage else None,
                timings=timings() if req.timings_per_token else None,
            )
            first.discard(index)
            yield sse(chunk)
        if req.include_usage:
            yield sse(
                CompletionResponse(
                    id=rid,
                    created=created,
                    model=self.served_model_name,
                    choices=[],
                    usage=usage(),
                    timings=timings() if req.timings_per_token else None,
                )
            )
        yield "data: [DONE]\n\n"

    def completion_logprobs(
        self,
        entries: list[TokenLogprob | None] | None,
        k: int | None,
        offset: int,
        token_ids: list[int] | None = None,
    ) -> CompletionLogprobs | None:
        """The legacy format; an entry None (the first prompt token's, with echo) is a token
        without logprobs, its id from ``token_ids``."""
        if k is None or not entries:
            return None
        token_ids = token_ids or [e.token_id for e in entries]
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.token_text(t): clamp(lp) for t, lp in entry.top[:k]}
            top.setdefault(token, clamp(entry.logprob))
            out.token_logprobs.append(clamp(entry.logprob))
            out.top_logprobs.append(top)
        return out

    def prompt_logprobs(
        self, entries: list[TokenLogprob | None] | None, k: int | None
    ) -> PromptLogprobs | None:
        """vLLM's shape: per prompt token (None for the first), the token and its ``k`` best
        alternatives keyed by token id."""
        if k is None or entries is None:
            return None
        out = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            top = [(entry.token_id, entry.logprob, entry.rank)]
            top += [(t, lp, rank) for rank, (t, lp) in enumerate(entry.top[:k], 1)]
            record: dict[str, PromptLogprob] = {}
            for t, lp, rank in top:
                decoded = self.token_text(t)
                record.setdefault(str(t), PromptLogprob(logprob=clamp(lp), rank=rank,
                                                        decoded_token=decoded))  # fmt: skip
            out.append(record)
        return out

    # -- /v1/chat/completions --

    async def start_chat(
        self, req: ChatCompletionRequest, rid: str
    ) -> tuple[Generation, list[int], ToolPlan | None]:
        """Admits a chat request and starts it: its generation, prompt ids and tool plan."""
        self.check_model(req.model)
        tool_plan = plan_tools(req, self.tokenizer("messages").template_takes_tools)
        constraint = tool_plan.constraint if tool_plan is not None else None
        params = [
            req.sampling_params(req.max_new_tokens, req.num_logprobs, k, req.prompt_logprobs,
                                constraint)
            for k in range(req.n)
        ]  # fmt: skip
        self.admit(1, req.n)
        keep = req.prompt_budget(self.engine.max_model_len)
        prompt = await asyncio.to_thread(self.chat_prompt, req.messages, True, req.tools, tool_plan)
        prompt = req.truncate(prompt, keep)
        gen = await self.generation(rid, [prompt], params, req.priority)
        return gen, prompt, tool_plan

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        rid = random_id("chatcmpl")
        gen, prompt, tool_plan = await self.start_chat(req, rid)
        if req.stream:
            return sse_response(self.chat_events(rid, gen, req, prompt, tool_plan))
        choices = await self.collect(gen, request)
        return json_response(
            ChatCompletionResponse(
                id=rid,
                model=self.served_model_name,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=message,
                        logprobs=self.chat_logprobs(c.logprobs, req.num_logprobs),
                        finish_reason=finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                    )
                    for c in choices
                    for message, finish_reason in [assistant_answer(c, tool_plan)]
                ],
                usage=gen.usage(len(prompt), req.n),
                prompt_logprobs=self.prompt_logprobs(
                    choices[0].prompt_logprobs, req.prompt_logprobs
                ),  # fmt: skip
                prompt_token_ids=prompt if req.return_token_ids else None,
                timings=gen.timings(len(prompt), req.n),
            )
        )

    async def chat_events(
        self,
        rid: str,
        gen: Generation,
        req: ChatCompletionRequest,
        prompt: list[int],
        tool_plan: ToolPlan | None,
    ) -> AsyncIterator[str]:
        """Content streams as it comes; with tools the answer is parsed, so it is sent whole
        (content or tool calls) when the choice ends."""
        created = int(time.time())
        sent = dict.fromkeys(gen.choices, 0)  # token ids each choice has sent

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None, **extra) -> str:
            if usage is None and req.continuous_usage:
                usage = gen.usage(len(prompt), req.n)
            timings = gen.timings(len(prompt), req.n) if req.timings_per_token else None
            return sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.served_model_name,
                    choices=choices,
                    usage=usage,
                    timings=timings,
                    **extra,
                )
            )

        for index in sorted(gen.choices):
            role = DeltaMessage(role="assistant", content="")
            # vLLM sends the prompt's ids once, in the stream's first chunk.
            first = req.return_token_ids and index == min(gen.choices)
            extra = {"prompt_token_ids": prompt} if first else {}
            yield chunk([ChatStreamChoice(index=index, delta=role)], **extra)
        async for choice, delta in gen.deltas():
            logprobs = self.chat_logprobs(delta.logprobs, req.num_logprobs)
            if not delta.text and delta.finish_reason is None and logprobs is None:
                continue  # its token ids (if any) go with the choice's next chunk
            if delta.finish_reason == "error":
                yield sse_error(failure(choice))
                yield "data: [DONE]\n\n"
                return
            content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
            finish_reason = delta.finish_reason
            if tool_plan is not None:
                if finish_reason is None and logprobs is None:
                    continue  # the answer is sent whole when it ends
                content, finish_reason = tool_delta(choice, tool_plan)
            ids = choice.token_ids[sent[choice.index] :]
            sent[choice.index] += len(ids)
            yield chunk(
                [
                    ChatStreamChoice(
                        index=choice.index,
                        delta=content,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=delta.stop_reason,
                        token_ids=list(ids) if req.return_token_ids else None,
                    )
                ]
            )
        if req.include_usage:
            yield chunk([], gen.usage(len(prompt), req.n))
        yield "data: [DONE]\n\n"

    def chat_logprobs(
        self, entries: list[TokenLogprob] | None, k: int | None
    ) -> ChatLogprobs | None:
        if k is None or entries is None:
            return None
        content = []
        for entry in entries:
            token = self.token_text(entry.token_id)
            top = [
                TopLogprob(token=(t := self.token_text(tid)), logprob=clamp(lp), bytes=utf8(t))
                for tid, lp in entry.top[:k]
            ]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=clamp(entry.logprob),
                    bytes=utf8(token),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    # -- /v1/responses --

    async def responses(self, req: ResponsesRequest, request: Request) -> Response:
        """The chat path under the Responses API's shapes (server/responses.py)."""
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            stored = self.response_store.get(req.previous_response_id, "previous_response_id")
            history = list(stored.conversation)
        turn = ResponseTurn(req, self.served_model_name, history)
        if req.store:  # known from now on, so that a DELETE before it ends finds it
            self.response_store.reserve(turn.id)
        try:
            return await self.answer_response(turn, request)
        except BaseException:
            self.response_store.finish(turn.id, None)  # ended before there was one to store
            raise

    async def answer_response(self, turn: ResponseTurn, request: Request) -> Response:
        try:
            gen, prompt, tool_plan = await self.start_chat(turn.chat, turn.id)
        except RequestError as e:  # named by the chat request's fields: say this API's
            if e.param in PARAM_NAMES:
                e.message = e.message.replace(e.param, PARAM_NAMES[e.param])
                e.param = PARAM_NAMES[e.param]
            raise
        if turn.req.stream:  # the stream ends the reservation, whichever way it ends
            return sse_response(self.response_events(turn, gen, prompt, tool_plan))
        (choice,) = await self.collect(gen, request)
        return json_response(self.finish_response(turn, gen, prompt, choice, tool_plan))

    def finish_response(
        self,
        turn: ResponseTurn,
        gen: Generation,
        prompt: list[int],
        choice: ChoiceState,
        tool_plan: ToolPlan | None,
    ) -> ResponseObject:
        """The finished response, stored when the request asked for it."""
        answer, finish_reason = assistant_answer(choice, tool_plan)
        body = turn.response(
            status_of(finish_reason), turn.output(answer, finish_reason), gen.usage(len(prompt), 1)
        )
        if turn.req.store:
            stored = StoredResponse.of(body.model_dump_json(), turn.conversation(answer))
            self.response_store.finish(turn.id, stored)
        return body

    async def response_events(
        self, turn: ResponseTurn, gen: Generation, prompt: list[int], tool_plan: ToolPlan | None
    ) -> AsyncIterator[str]:
        """Text streams as it comes; with tools the answer is parsed, so its items are sent
        whole when it ends (as chat_events does)."""
        events = ResponseEvents()
        started = False  # whether the message item has been announced
        try:
            for event in events.started(turn.response("in_progress")):
                yield event
            async for choice, delta in gen.deltas():
                check_finished(choice)
                if tool_plan is not None or not delta.text:
                    continue
                if not started:
                    message = OutputMessage(id=turn.message_id, content=[])
                    for event in events.message_started(0, message):
                        yield event
                    started = True
                yield events.text_delta(0, turn.message_id, delta.text)
            body = self.finish_response(turn, gen, prompt, gen.choices[0], tool_plan)
            done = events.message_done(0, body.output[0]) if started else []
            for event in done + events.items(body.output[int(started) :], int(started)):
                yield event
            yield events.finished(body)
        except Exception as exc:  # the headers are gone: the failure is the stream's last event
            if not isinstance(exc, RequestError):
                log.error("response stream failed", exc_info=exc)
            yield events.error(exc)
        finally:  # ended early (a failure, a disconnect): nothing to store
            self.response_store.finish(turn.id, None)

    # -- tokenizer endpoints --

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """At most max_model_len tokens, as a prompt to generate from: a longer text is refused
        with no more work than it takes to know (from its length where that is enough), so the
        work, the answer and the memory of one request stay bounded by the model, not by the
        body limit."""
        self.check_model(req.model)
        limit = self.engine.max_model_len
        param = "prompt" if req.messages is None else "messages"
        try:
            if req.messages is not None:
                # The ids exactly as the chat endpoint would see them.
                ids = self.chat_prompt(req.messages, req.add_generation_prompt, max_tokens=limit)
            else:
                ids = self.text_prompt(req.prompt, req.add_special_tokens, limit)
        except TooManyTokens as e:
            message = (
                f"This model's maximum context length is {limit} tokens, and /tokenize counts "
                f"no further. However, `{param}` is {e} long. Please reduce the length of "
                f"`{param}`."
            )
            raise RequestError(message, param=param, code="context_length_exceeded") from None
        strs = [self.token_text(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=limit, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        tok = self.tokenizer("tokens")
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            message = f"Token ids must be in [0, {tok.vocab_size}); got {bad[0]}."
            raise RequestError(message, param="tokens")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))

    def tokenizer_info(self) -> TokenizerInfo:
        """vLLM's /tokenizer_info: the tokenizer's config as this server reads it."""
        tok = self.tokenizer("tokenizer")
        eos = tok.eos_token_ids

        def text(token_id: int | None) -> str | None:
            return tok.token_str(token_id) if token_id is not None else None

        return TokenizerInfo(
            tokenizer_class=tok.tokenizer_class,
            model=self.served_model_name,
            vocab_size=tok.vocab_size,
            model_max_length=self.engine.max_model_len,
            bos_token=text(tok.bos_token_id),
            bos_token_id=tok.bos_token_id,
            eos_token=text(eos[0] if eos else None),
            eos_token_id=eos[0] if eos else None,
            eos_token_ids=list(eos),
            chat_template=tok.chat_template,
        )

    def models(self) -> ModelList:
        card = ModelCard(
            id=self.served_model_name,
            root=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
        )
        return ModelList(data=[card])


# ---- wire helpers ----


def kvserve_version() -> str:
    try:
        return importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"


def token_id_fields(
    req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int] | None, ids: list[int]
) -> dict[str, list[int]]:
    """vLLM's return_token_ids on a completion choice: its prompt's ids (in a stream, the first
    chunk's only) and its completion's."""
    if not req.return_token_ids:
        return {}
    fields = {"token_ids": list(ids)}
    if prompt_ids is not None:
        fields["prompt_token_ids"] = list(prompt_ids)
    return fields


def assistant_answer(
    choice: ChoiceState, tool_plan: ToolPlan | None
) -> tuple[AssistantMessage, str | None]:
    """The choice's answer and finish reason: its text, or with tools the content and calls
    parsed from it ("tool_calls" when there are calls; an answer cut short by max_tokens that
    does not parse stays text)."""
    text = AssistantMessage(content=choice.text), choice.finish_reason
    if tool_plan is None or choice.finish_reason != "stop":
        return text
    try:
        content, calls = tool_plan.parse(choice.text)
    except (ValueError, KeyError, TypeError):
        return text
    reason = "tool_calls" if calls else choice.finish_reason
    return AssistantMessage(content=content, tool_calls=calls), reason


def tool_delta(choice: ChoiceState, tool_plan: ToolPlan) -> tuple[DeltaMessage, str | None]:
    """A streamed choice's delta under tools: nothing until it ends, then the whole answer."""
    if choice.finish_reason is None:
        return DeltaMessage(), None
    message, finish_reason = assistant_answer(choice, tool_plan)
    calls = [
        DeltaToolCall(index=i, id=c.id, function=c.function)
        for i, c in enumerate(message.tool_calls)
    ]
    return DeltaMessage(content=message.content, tool_calls=calls or None), finish_reason


def clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def json_response(body: BaseModel, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    if not isinstance(exc, RequestError):
        log.error("stream failed", exc_info=exc)
    return f"data: {error_body(exc).model_dump_json()}\n\n"


async def guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Headers are gone once a stream starts: a late failure becomes an error event."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield sse_error(exc)
        yield "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        guard_stream(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def error_body(exc: Exception) -> ErrorResponse:
    if isinstance(exc, RequestError):
        info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    else:
        message = f"Internal server error: {type(exc).__name__}: {exc}"
        info = ErrorInfo(message=message, type="internal_server_error")
    return ErrorResponse(error=info)


def error_response(status: int, message: str, param: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return json_response(
        ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param)), status
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> Response:
        response = json_response(error_body(exc), exc.status)
        if isinstance(exc, QueueFullError):
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(exc.status_code, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(ClientGoneError)
    async def client_gone(_: Request, exc: ClientGoneError) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        return json_response(error_body(exc), 500)


# What the API answers besides 200, as the OpenAPI document describes it (never 422: a body
# that does not validate is a 400, as OpenAI answers).
ERROR_STATUSES = {
    "400": "Invalid request: the message names the parameter.",
    "401": "Missing or wrong API key (when the server has keys).",
    "404": "Unknown model, route or stored response.",
    "408": "The request body stopped arriving for --request-body-timeout seconds.",
    "413": "Request body over --max-request-bytes.",
    "429": "Queue full; retry after the Retry-After header's seconds.",
    "500": "Internal error.",
    "503": "Shutting down, or the engine is not progressing.",
}


def openapi_with_errors(app: FastAPI) -> Callable[[], dict]:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema["components"]["schemas"]
            body = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}), ErrorResponse=body)
            error = {"$ref": "#/components/schemas/ErrorResponse"}
            for ops in schema["paths"].values():
                for op in ops.values():
                    op["responses"].pop("422", None)
                    for status, description in ERROR_STATUSES.items():
                        content = {"application/json": {"schema": error}}
                        op["responses"][status] = {"description": description, "content": content}
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def install_response_routes(app: FastAPI, server: OpenAIServer) -> None:
    """/v1/responses, and its stored responses by id."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await server.responses(body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        stored = server.response_store.get(response_id)
        return Response(stored.body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not server.response_store.delete(response_id):
            raise ResponseNotFoundError(response_id)
        return Response(deleted(response_id), media_type="application/json")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        server.response_store.get(response_id)
        message = "Only background responses can be cancelled; this server runs none."
        raise RequestError(message, param="response_id")


def probe_answer(reason: str | None, failing: str) -> Response:
    """A probe's answer: 200 ok, or 503 saying why not (``reason``) after ``failing``."""
    if reason is not None:
        return error_response(503, f"{failing}: {reason}.")
    return Response('{"status":"ok"}', media_type="application/json")


def build_app(
    engine: AsyncEngine, args: ServerArgs | None = None, extra_model_names: Iterable[str] = ()
) -> FastAPI:
    """The HTTP app over a running engine. ``model`` in a request must be one of the names."""
    args = args or ServerArgs()
    server = OpenAIServer(engine, args, extra_model_names)
    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM server")
    app.state.server = server
    app.openapi = openapi_with_errors(app)
    app.add_middleware(
        Guard,
        api_keys=args.api_key,
        max_bytes=args.max_request_bytes,
        draining=lambda: server.draining,
        body_timeout=args.request_body_timeout,
    )
    install_error_handlers(app)

    # Kubernetes' two questions: /health whether to restart this server (liveness), /ready
    # whether to send it traffic (readiness). A slow server is alive: only /ready turns 503.
    @app.get("/health")
    async def health() -> Response:
        return probe_answer(server.liveness(), "Unhealthy")

    @app.get("/ready")
    async def ready() -> Response:
        return probe_answer(server.readiness(), "Not ready")

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(server.models())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        server.check_model(model)
        return json_response(server.models().data[0])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    install_response_routes(app, server)

    @app.get("/version")
    async def version() -> Response:
        return json_response(VersionResponse(version=kvserve_version()))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return json_response(await asyncio.to_thread(server.tokenizer_info))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        blocks = await engine.reset_prefix_cache()
        return Response(f'{{"status":"ok","blocks":{blocks}}}', media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return json_response(await asyncio.to_thread(server.tokenize, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return json_response(await asyncio.to_thread(server.detokenize, body))

    return app
