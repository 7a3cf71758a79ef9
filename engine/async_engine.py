"""The engine in its own thread, fed and drained from asyncio.

Hand-off is a thread-safe queue in and ``loop.call_soon_threadsafe`` out. A consumer that
stops iterating (client gone, task cancelled) aborts its request; the engine thread frees its
blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")


class AsyncEngine:
    def __init__(self, args: EngineArgs):
        self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.cache_config = self.engine.cache_config
        self.model_name = self.engine.model_config.name
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Output deltas of one request; leaving the loop early aborts it."""
        self.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request_id, prompt_token_ids, params, priority))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> dict:
        return self.engine.stats()

    @property
    def registry(self):
        """The engine's Prometheus registry, for /metrics."""
        return self.engine.metrics.registry

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, prompt, params, priority = command
            try:
                self.engine.add_request(rid, prompt, params, priority)
            except Exception as e:  # reported to its caller, never fatal to the loop
                self._deliver(rid, e)
        elif kind == "abort":
            out = self.engine.abort(command[1])
            if out is not None:
                self._deliver(command[1], out)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                block = not self.engine.has_unfinished
                while True:
                    self._handle(self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            if self._stopping.is_set():
                break
            try:
                outputs = self.engine.step()
            except Exception:  # keep serving; the step's requests were failed by the engine
                log.exception("engine loop error")
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
