"""What a request passes before any route sees it: the drain, the API key, the body size and
the pace at which the body arrives.

A plain ASGI middleware (it never buffers a response, so streams pass through untouched).
/health, /ready and /metrics are always open: probes and scrapers carry no key, and during a
drain /ready itself answers 503. The API description (/openapi.json, /docs) is open too.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.protocol import ErrorInfo, ErrorResponse

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
DOC_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# Seconds a client is told to wait before retrying elsewhere while this server drains.
DRAIN_RETRY_AFTER = 1


def error(status: int, message: str, kind: str, code: str, headers: dict | None = None):
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code))
    return Response(body.model_dump_json(), status, headers, media_type="application/json")


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def too_large(max_bytes: int) -> str:
    return f"The request body is larger than this server's limit of {max_bytes} bytes."


def stalled(timeout: float) -> HTTPException:
    message = f"The request body stopped arriving: no byte of it for {timeout:g} s."
    # Closing is the point: the rest of the body may never come, and the socket would stay.
    return HTTPException(408, message, headers={"Connection": "close"})


class Guard:
    """Refuses new requests while ``draining()`` (503, Retry-After), requests without one of
    ``api_keys`` when there are any (401, as OpenAI: code ``invalid_api_key``), bodies over
    ``max_bytes`` (413): at once from Content-Length, else as soon as the bytes arriving pass it,
    and bodies that stop arriving for ``body_timeout`` seconds before their end (408, and the
    connection closes). The last two are raised by the route's body read, and the app's handler
    answers; uvicorn bounds neither (its keep-alive timeout starts only after a response)."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        max_bytes: int,
        draining: Callable[[], bool],
        body_timeout: float = 10.0,
    ):
        self.app = app
        self.api_keys = tuple(key.encode() for key in api_keys)
        self.max_bytes = max_bytes
        self.draining = draining
        self.body_timeout = body_timeout

    def _limited(self, receive: Receive) -> Receive:
        received = 0
        body_done = False

        async def receive_limited():
            nonlocal received, body_done
            if body_done:  # what follows is the wait for a disconnect, which has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise stalled(self.body_timeout) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, too_large(self.max_bytes))
            return message

        return receive_limited

    def _authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope)
        if token is None:
            return False
        given = token.encode()
        # Every key compared, in constant time each: no early exit tells a key's position.
        return sum(hmac.compare_digest(given, key) for key in self.api_keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        response = None
        if self.draining():
            response = error(
                503,
                "The server is shutting down and accepts no new requests; retry on another "
                "replica.",
                "server_error",
                "shutting_down",
                {"Retry-After": str(DRAIN_RETRY_AFTER)},
            )
        elif self.api_keys and scope["path"] not in DOC_PATHS and not self._authorized(scope):
            response = error(
                401,
                "Incorrect or missing API key. Send it as `Authorization: Bearer KEY`.",
                "invalid_request_error",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        elif (content_length(scope) or 0) > self.max_bytes:
            message = too_large(self.max_bytes)
            response = error(413, message, "invalid_request_error", "request_too_large")
        if response is not None:
            return await response(scope, receive, send)
        return await self.app(scope, self._limited(receive), send)
