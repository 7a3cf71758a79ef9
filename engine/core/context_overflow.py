"""Context overflow: what happens when prompt + generation reach max_model_len.

Everything about it lives here: the choices (``CONTEXT_POLICIES``, ``DEFAULT_POLICY``), a
request's or the server's choice (``ContextOverflow``, the one validator), and the policies,
small objects with two decision methods: ``admit`` before any work (refuse, drop prompt
tokens, or take the request as it is) and ``on_full`` when a running sequence fills the
context (finish it, or drop tokens and go on). They read plain numbers (``ContextState``) and
change nothing; the engine asks at admission, the scheduler when the context is full, and the
scheduler carries out and counts what they decide. Pure Python.

Context overflow::

    limit = 16, block_size = 4, n_keep = 4
    tokens:  [ 0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15 ]  the cache is full
             |-- kept ---|---- discarded -------|---- kept, moved 8 positions down ---|
    shift:   [ 0  1  2  3 | 12 13 14 15 ]  then generation goes on at position 8
    sink:    as shift, one block at a time: the recent window stays as long as it can
    stop:    finish_reason "length"
    error:   prompt + max_tokens over the limit is refused before any work
    truncate: the prompt loses tokens after the first n_keep so that prompt + max_tokens fits

A running sequence's cache drops whole blocks, so ``shift`` and ``sink`` round n_keep and
n_discard up to block multiples; a prompt is not cached yet, so ``truncate`` is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.core.errors import RequestError

CONTEXT_POLICIES = ("error", "truncate", "stop", "shift", "sink")
DEFAULT_POLICY = "error"  # as OpenAI: a request that cannot fit is refused

# The first tokens draw attention out of proportion to their content (StreamingLLM's sinks);
# keeping a few by default is what keeps a shifted or truncated sequence fluent.
DEFAULT_KEEP = 4


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ContextOverflow:
    """A request's context-overflow choice, or the server default.

    ``n_keep``: tokens kept at the start (-1: the whole prompt); for ``sink`` the attention
    sinks. ``n_discard``: tokens dropped at each overflow by ``shift`` (default: half of what
    follows the kept ones) and ``sink`` (default: one block). None: the policy's default.
    """

    policy: str = DEFAULT_POLICY
    n_keep: int | None = None
    n_discard: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in CONTEXT_POLICIES:
            raise RequestError(
                f"overflow.policy must be one of {', '.join(CONTEXT_POLICIES)}; "
                f"got {self.policy!r}.",
                param="overflow.policy",
            )
        if self.n_keep is not None and self.n_keep < -1:
            raise RequestError("overflow.n_keep must be -1 or more.", param="overflow.n_keep")
        if self.n_discard is not None and self.n_discard < 1:
            raise RequestError("overflow.n_discard must be at least 1.", param="overflow.n_discard")


# ---- decisions ----


@dataclass(frozen=True)
class Fits:
    """Nothing to do."""


@dataclass(frozen=True)
class Reject:
    message: str
    code: str = "context_length_exceeded"


@dataclass(frozen=True)
class Finish:
    """End the sequence with finish_reason "length"."""


@dataclass(frozen=True)
class Drop:
    """Remove ``count`` tokens starting at ``start`` from the sequence (and its cache)."""

    start: int
    count: int


@dataclass(frozen=True)
class ContextState:
    """A sequence against the context limit, in plain numbers: its prompt at admission
    (``admit``), or its prompt and output once they fill the context (``on_full``)."""

    prompt_len: int
    max_tokens: int | None  # the request's output limit, None: up to the context limit
    limit: int  # max_model_len
    block_size: int
    # A shift drops only tokens before this position (after the kept ones, in whole blocks):
    # the cache's whole blocks, less what a wrapped sliding window still reaches back to
    # (``KVCacheManager.discard_end``). At admission: when the sequence first fills the context.
    discard_end: int
    can_rotate: bool = True  # admit: whether the model can re-rotate its cached keys
    dropped: int = 0  # on_full: tokens the sequence has discarded so far
    max_dropped: int | None = None  # on_full: how many it may discard in all (None: no bound)


class ContextPolicy:
    """By default: refuse a prompt that fills the context alone; finish at a full context."""

    name: ClassVar[str]

    def admit(self, s: ContextState) -> Fits | Reject | Drop:
        """Before any work: take the request as it is, refuse it, or drop prompt tokens."""
        return _prompt_too_long(s) or Fits()

    def on_full(self, s: ContextState) -> Finish | Drop:
        """A running sequence has filled the context: finish it, or drop tokens and go on."""
        return Finish()


def _prompt_too_long(s: ContextState) -> Reject | None:
    if s.prompt_len < s.limit:
        return None
    return Reject(
        f"This model's maximum context length is {s.limit} tokens. However, your prompt has "
        f"{s.prompt_len} tokens. Please reduce the length of the messages."
    )


class ErrorPolicy(ContextPolicy):
    """Refuse what cannot fit, as OpenAI does; a request without max_tokens stops at the limit."""

    name = "error"

    def admit(self, s: ContextState) -> Fits | Reject:
        wanted = s.prompt_len + (s.max_tokens or 0)
        if s.prompt_len >= s.limit or wanted > s.limit:
            return Reject(
                f"This model's maximum context length is {s.limit} tokens. However, you "
                f"requested {wanted} tokens ({s.prompt_len} in the messages, "
                f"{s.max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        return Fits()


class StopPolicy(ContextPolicy):
    """Generate until the context is full, then finish with "length"."""

    name = "stop"


@dataclass(frozen=True)
class TruncatePolicy(ContextPolicy):
    """Drop the oldest prompt tokens after the first ``n_keep`` so that the request fits."""

    name: ClassVar[str] = "truncate"
    n_keep: int = DEFAULT_KEEP

    def admit(self, s: ContextState) -> Fits | Reject | Drop:
        room = s.limit - (s.max_tokens or 1)  # prompt tokens that leave room for the output
        if s.prompt_len <= room:
            return Fits()
        keep = s.prompt_len if self.n_keep == -1 else self.n_keep
        if room < max(keep, 1):
            return Reject(
                f"max_tokens={s.max_tokens} leaves room for {max(room, 0)} prompt tokens of "
                f"the model's {s.limit}; truncation keeps the first {keep}. Reduce max_tokens "
                "or overflow.n_keep."
            )
        return Drop(keep, s.prompt_len - room)


@dataclass(frozen=True)
class ShiftPolicy(ContextPolicy):
    """llama.cpp's context shift: keep ``n_keep``, drop ``n_discard`` after them, go on.

    Without max_tokens there is no end to go on to: the request stops at the limit; nor does
    it go on once its shifts would discard more than ``max_dropped`` tokens in all
    (``--max-overflow-tokens``), so no request generates forever.
    """

    name: ClassVar[str] = "shift"
    n_keep: int = DEFAULT_KEEP
    n_discard: int | None = None  # None: half of what follows the kept tokens

    def plan(self, s: ContextState) -> tuple[int, int]:
        """(first token dropped, tokens dropped) for a full context, block aligned."""
        bs = s.block_size
        keep = round_up(s.prompt_len if self.n_keep == -1 else self.n_keep, bs)
        wanted = self.n_discard or self._default_discard(s.limit - keep, bs)
        room = max(0, s.discard_end - keep)
        return keep, min(round_up(wanted, bs), room // bs * bs)

    def _default_discard(self, rest: int, block_size: int) -> int:
        return rest // 2

    def admit(self, s: ContextState) -> Fits | Reject:
        if not s.can_rotate:
            return Reject(
                f"this model cannot re-rotate its cached keys; overflow policy {self.name!r} "
                "is not available.",
                code="invalid_overflow",
            )
        too_long = _prompt_too_long(s)
        if too_long or s.max_tokens is None:
            return too_long or Fits()
        keep, count = self.plan(s)
        if count < s.block_size:
            return Reject(
                f"overflow {self.name!r} keeps the first {keep} tokens (n_keep rounded up "
                f"to a block of {s.block_size}); that leaves nothing to discard in a "
                f"context of {s.limit}. Reduce overflow.n_keep.",
                code="invalid_overflow",
            )
        return Fits()

    def on_full(self, s: ContextState) -> Finish | Drop:
        if s.max_tokens is None:
            return Finish()
        keep, count = self.plan(s)
        if s.max_dropped is not None and s.dropped + count > s.max_dropped:
            return Finish()
        return Drop(keep, count) if count >= s.block_size else Finish()


@dataclass(frozen=True)
class SinkPolicy(ShiftPolicy):
    """StreamingLLM: ``n_keep`` attention sinks plus the most recent window.

    The oldest block after the sinks leaves whenever the cache is full, so the window is never
    shorter than ``max_model_len - n_keep - block_size``; positions are those in the cache.
    """

    name: ClassVar[str] = "sink"

    def _default_discard(self, rest: int, block_size: int) -> int:
        return block_size


def context_policy(choice: ContextOverflow) -> ContextPolicy:
    keep = DEFAULT_KEEP if choice.n_keep is None else choice.n_keep
    if choice.policy == "error":
        return ErrorPolicy()
    if choice.policy == "stop":
        return StopPolicy()
    if choice.policy == "truncate":
        return TruncatePolicy(keep)
    if choice.policy == "shift":
        return ShiftPolicy(keep, choice.n_discard)
    return SinkPolicy(keep, choice.n_discard)
