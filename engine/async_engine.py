"""The engine in its own thread, fed and drained from asyncio.

Hand-off is a thread-safe queue in and ``loop.call_soon_threadsafe`` out. A consumer that
stops iterating (client gone, task cancelled) aborts its request; the engine thread frees its
blocks before the next step. The engine thread beats a heartbeat after every command batch and
step (and every ``IDLE_BEAT_S`` when idle), so the time since its last beat is how long it has
been inside the current step: a caller tells a slow engine (``readiness``) from a hung or dead
one (``liveness``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.core.errors import EngineDeadError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import Admitted, LLMEngine

log = logging.getLogger("kvserve.engine")

# An idle engine thread still beats this often, so its heartbeat is never stale when work comes.
IDLE_BEAT_S = 1.0


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate: what ``submit`` takes, several at a time. Its admission was
    decided on the caller's thread (``AsyncEngine.admit``); the engine thread carries the
    decision out as it is."""

    request_id: str
    admitted: Admitted
    priority: int = 0


class AsyncEngine:
    engine: LLMEngine  # built and then stepped by the engine thread

    def __init__(self, args: EngineArgs):
        # The engine is built in its own thread, which then runs every step: all of torch's
        # work stays on one thread and so one OpenMP thread team. A second team (from loading
        # on the caller's thread) leaves more OpenMP threads than cores, and OpenMP then stops
        # spinning between parallel regions: each op pays a wake-up.
        self._stopping = threading.Event()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        built: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(args, built), name="kvserve-engine", daemon=True
        )
        self._thread.start()
        error = built.get()
        if error is not None:
            raise error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.cache_config = self.engine.cache_config
        self.model_name = self.engine.model_config.name
        self.last_beat = time.monotonic()  # the engine thread's last sign of progress

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> Admitted:
        """Decides whether the engine takes the request, on the caller's thread: raises
        RequestError if not (``LLMEngine.admit``). Compiling a constraint may take up to
        ``max_grammar_compile_s``: call it in a worker thread, not on an event loop."""
        return self.engine.admit(prompt_token_ids, params)

    def check_admission(self, num_requests: int, num_tokens: int = 0) -> None:
        """Raises QueueFullError when the queue would refuse this many requests now."""
        self.engine.check_admission(num_requests, num_tokens)

    def submit(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queues ``requests`` as one group, admitted or refused (429) as a whole; returns the
        output deltas of each. A refused or invalid group ends each stream with the engine's
        error. Call from the event loop; leaving a stream early aborts it."""
        loop = asyncio.get_running_loop()
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError(f"request ids {ids} are already in use")
        for rid in ids:
            self._streams[rid] = (loop, asyncio.Queue())
        self._commands.put(("add", requests))
        return [self._stream(rid) for rid in ids]

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Output deltas of one request; leaving the loop early aborts it."""
        if params.structured is not None:  # compiles its constraint: off the event loop
            admitted = await asyncio.to_thread(self.admit, prompt_token_ids, params)
        else:
            admitted = self.admit(prompt_token_ids, params)
        (stream,) = self.submit([EngineRequest(request_id, admitted, priority)])
        async for out in stream:
            yield out

    async def _stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await self._streams[request_id][1].get()
                if isinstance(item, BaseException):
                    finished = True  # the engine refused it, or ``fail`` ended it
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix block, between steps; returns how many were cached."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("reset_prefix_cache", loop, done))
        return await done

    def fail(self, request_id: str, error: BaseException) -> None:
        """Ends a request's stream with ``error`` now, from the event loop, whatever the engine
        thread is doing (even stuck in a step), and aborts it in the engine."""
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[1].put_nowait(error)
        self.abort(request_id)

    def liveness(self, hang_timeout: float) -> str | None:
        """None while the engine thread is alive and stepping; else why not: it has stopped
        (an engine that cannot go on ends it), or it has been inside one step (or one batch of
        commands) for ``hang_timeout`` seconds. A slow step is still a live one; only a step
        longer than any this server should ever take counts as hung."""
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        busy = time.monotonic() - self.last_beat
        if busy > hang_timeout:
            return f"the engine thread has been inside one step for {busy:.0f} s"
        return None

    def readiness(self, stall_timeout: float, hang_timeout: float) -> str | None:
        """None when new work would be served; else why not: the engine is not live, or work is
        pending and it has not completed a step (or a batch of commands) for ``stall_timeout``
        seconds."""
        reason = self.liveness(hang_timeout)
        if reason is not None:
            return reason
        pending = self.engine.has_unfinished or not self._commands.empty()
        stalled = time.monotonic() - self.last_beat
        if pending and stalled > stall_timeout:
            return f"the engine has made no progress for {stalled:.0f} s with work pending"
        return None

    def stats(self) -> dict:
        return self.engine.stats()

    @property
    def registry(self):
        """The engine's Prometheus registry, for /metrics."""
        return self.engine.metrics.registry

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread, waiting up to ``timeout`` seconds for its current step."""
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=timeout)
        self.engine.shutdown()

    # -- engine thread ------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            requests: list[EngineRequest] = command[1]
            try:
                self.engine.add_requests([(r.request_id, r.admitted, r.priority) for r in requests])
            except Exception as e:  # reported to its callers, never fatal to the loop
                for r in requests:
                    self._deliver(r.request_id, e)
        elif kind == "abort":
            out = self.engine.abort(command[1])
            if out is not None:
                self._deliver(command[1], out)
        elif kind == "reset_prefix_cache":
            _, loop, done = command
            loop.call_soon_threadsafe(done.set_result, self.engine.reset_prefix_cache())

    def _take_commands(self) -> None:
        """Handles the commands queued so far (not those arriving meanwhile, which wait for
        the next step); when idle, waits for one, beating every ``IDLE_BEAT_S``."""
        if not self.engine.has_unfinished:
            try:
                self._handle(self._commands.get(timeout=IDLE_BEAT_S))
            except queue.Empty:
                return
        for _ in range(self._commands.qsize()):
            self._handle(self._commands.get_nowait())

    def _run(self, args: EngineArgs, built: queue.Queue) -> None:
        try:
            self.engine = LLMEngine(args)
        except BaseException as e:  # raised again on the caller's thread
            built.put(e)
            return
        built.put(None)
        while not self._stopping.is_set():
            self._take_commands()
            self.last_beat = time.monotonic()
            if self._stopping.is_set():
                break
            try:
                outputs = self.engine.step()
            except EngineDeadError as e:  # nothing can run any more: every request ends
                log.error("%s", e)
                for request_id in list(self._streams):
                    self._deliver(request_id, e)
                break
            except Exception:  # keep serving; the step's requests were failed by the engine
                log.exception("engine loop error")
                continue
            finally:
                self.last_beat = time.monotonic()
            for out in outputs:
                self._deliver(out.request_id, out)
