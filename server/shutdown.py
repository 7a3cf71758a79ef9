"""Graceful drain with a deadline: uvicorn, told what to do on SIGTERM.

First SIGTERM or SIGINT: stop admitting (new requests get 503 with Retry-After, and /ready 503,
while the socket stays open so a keep-alive client hears it), let the requests in flight finish
for up to ``shutdown_timeout`` seconds, then end the rest with an error (a final error event and
``[DONE]`` on a stream) and exit. It never waits on the engine thread: a stuck engine delays
nothing. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from types import FrameType

import uvicorn

from server.app import OpenAIServer, ShuttingDownError

log = logging.getLogger("kvserve.server")

# After the deadline, how long the ended requests get to send their last bytes.
FLUSH_S = 2.0
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: OpenAIServer, timeout: float):
        super().__init__(config)
        self.openai = server
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.openai.draining or self._loop is None:
            log.warning("second signal: exiting now")
            os._exit(1)
        self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Starts the drain (on the event loop); the server exits when it ends."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        server = self.openai
        server.draining = True
        n = len(server.active)
        log.info("draining: %d requests in flight, up to %.0f s", n, self.timeout)
        deadline = time.monotonic() + self.timeout
        while server.active and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if server.abort_all(ShuttingDownError()):
            log.warning("drain deadline passed: requests in flight ended with an error")
            flush_until = time.monotonic() + FLUSH_S
            while self.server_state.tasks and time.monotonic() < flush_until:
                await asyncio.sleep(POLL_S)
        self.should_exit = True


def run(app, server: OpenAIServer, host: str, port: int, log_level: str, timeout: float) -> None:
    """Serves ``app`` until a signal, then drains as described above."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S
    )
    DrainingServer(config, server, timeout).run()
