"""Errors a request can fail with; the server turns them into OpenAI-shaped responses."""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request: 400 with the offending parameter named."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class QueueFullError(RequestError):
    """Admission control refused the request: 429 with Retry-After."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message, code="queue_full")
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): every request ends with it."""
