"""What the engine hands back for a request: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.errors import RequestError


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int = 1  # 1 + how many tokens are more likely


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    error: str | None = None  # why, when finish_reason is "error"
    # When the request itself was at fault (a constraint it cannot meet, found while sampling):
    # the error to answer it with, a 4xx rather than a server error.
    fault: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """From ``AsyncEngine.generate``: a delta (new text/tokens since the last one).

    From ``LLM.generate``: the whole completion.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first,
    # which nothing predicts), in the request's first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
