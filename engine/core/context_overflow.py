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

Eviction by importance (``snapkv``, ``h2o``, ``knorm``): the cache keeps the tokens that matter
at their own positions, compacted into fewer blocks (``Evict``). It acts when the context fills
(keeping ``limit - n_discard``) and, with a ``kv_budget``, whenever the sequence holds more
than its budget: at the end of its prompt, then each time decoding has added a block. Which
tokens stay is the model runner's choice (``engine.worker.eviction``): it reads the scores the
attention kernels accumulated; here only how many, and when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.core.errors import RequestError

IMPORTANCE_POLICIES = ("snapkv", "h2o", "knorm")
SCORED_POLICIES = ("snapkv", "h2o")  # those that read scores the attention kernels accumulate
CONTEXT_POLICIES = ("error", "truncate", "stop", "shift", "sink", *IMPORTANCE_POLICIES)
DEFAULT_POLICY = "error"  # as OpenAI: a request that cannot fit is refused

# The first tokens draw attention out of proportion to their content (StreamingLLM's sinks);
# keeping a few by default is what keeps a shifted or truncated sequence fluent.
DEFAULT_KEEP = 4
# Recent tokens eviction always keeps; SnapKV's observation window (kvpress's default size).
DEFAULT_WINDOW = 64
SELECTIONS = ("head", "layer")  # an importance policy chooses per KV head, or once per layer
SETTINGS = ("n_keep", "n_discard", "kv_budget", "window", "selection")
# The settings each policy reads. Any other one a request sets is refused by name: it would
# change nothing, and the client would believe it had.
POLICY_FIELDS: dict[str, tuple[str, ...]] = {
    "error": (),
    "stop": (),
    "truncate": ("n_keep",),
    "shift": ("n_keep", "n_discard"),
    "sink": ("n_keep", "n_discard"),
    **dict.fromkeys(IMPORTANCE_POLICIES, SETTINGS),
}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ContextOverflow:
    """A request's context-overflow choice, or the server default.

    ``n_keep``: tokens kept at the start (-1: the whole prompt); for ``sink`` the attention
    sinks. ``n_discard``: tokens dropped at each overflow by ``shift`` (default: half of what
    follows the kept ones) and ``sink`` (default: one block), and by an importance policy when
    the context fills (default: half). ``kv_budget``: most tokens an importance policy lets the
    sequence cache (None or 0: no budget). ``window``: recent tokens it always keeps.
    ``selection``: whether it chooses per KV head or once per layer. None: the default. A
    setting the policy does not read (``POLICY_FIELDS``) is refused by name.
    """

    policy: str = DEFAULT_POLICY
    n_keep: int | None = None
    n_discard: int | None = None
    kv_budget: int | None = None
    window: int | None = None
    selection: str | None = None

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
        if self.window is not None and self.window < 0:
            raise RequestError("overflow.window must be 0 or more.", param="overflow.window")
        if self.selection not in (None, *SELECTIONS):
            raise RequestError(
                f"overflow.selection must be one of {', '.join(SELECTIONS)}; "
                f"got {self.selection!r}.",
                param="overflow.selection",
            )
        reads = POLICY_FIELDS[self.policy]
        for name in SETTINGS:
            if getattr(self, name) is not None and name not in reads:
                takers = [p for p, fields in POLICY_FIELDS.items() if name in fields]
                raise RequestError(
                    f"overflow.{name} does not apply to policy {self.policy!r} (it reads "
                    f"{', '.join(reads) or 'no other setting'}); {name} is read by "
                    f"{', '.join(takers)}.",
                    param=f"overflow.{name}",
                )
        if self.kv_budget is not None and (self.kv_budget < 0 or 0 < self.kv_budget <= self.sinks):
            raise RequestError(
                f"overflow.kv_budget must be 0 (none) or more than the {self.sinks} tokens kept "
                "at the start (n_keep).",
                param="overflow.kv_budget",
            )

    def check_limit(self, limit: int) -> None:
        """Refuses an ``n_discard`` that no overflow can carry out: a context of ``limit``
        tokens never holds that many to drop, and the policies would quietly discard less."""
        if self.n_discard is not None and self.n_discard >= limit:
            raise RequestError(
                f"overflow.n_discard must be less than the context length ({limit} tokens); "
                f"got {self.n_discard}.",
                param="overflow.n_discard",
            )

    @property
    def sinks(self) -> int:
        return DEFAULT_KEEP if self.n_keep is None else max(self.n_keep, 0)


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
class Evict:
    """Keep ``keep`` of the sequence's cached tokens, the runner choosing which."""

    keep: int


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

    def on_full(self, s: ContextState) -> Finish | Drop | Evict:
        """A running sequence has filled the context: finish it, or drop tokens and go on."""
        return Finish()

    def over_budget(
        self, cached: int, decoding: bool, prompt_done: bool, block_size: int
    ) -> Evict | None:
        """After a step: whether a sequence holding ``cached`` tokens must evict some
        (``decoding``: its prompt was computed before this step; ``prompt_done``: it is now).
        Only importance policies do."""
        return None

    def score_from(self, prompt_len: int) -> int | None:
        """The first position whose query's attention to the cached keys is accumulated as
        their score (None: no scores)."""
        return None


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


@dataclass(frozen=True)
class ImportancePolicy(ContextPolicy):
    """Evict the least important cached tokens, keeping ``sinks`` first ones and ``window``
    recent ones: when the context fills, down to ``limit - n_discard`` (default: half of it),
    and with a ``budget`` down to it, at the end of the prompt and whenever decoding has added
    a block more (so that compaction runs once a block, not once a token). The sequence
    stops with "length" once it would evict more than ``max_dropped`` tokens in all."""

    name: str = "snapkv"
    sinks: int = DEFAULT_KEEP
    window: int = DEFAULT_WINDOW
    budget: int = 0
    n_discard: int | None = None
    per_head: bool = True

    def admit(self, s: ContextState) -> Fits | Reject:
        too_long = _prompt_too_long(s)
        if too_long is not None:
            return too_long
        if self.sinks >= s.limit - 1:
            return Reject(
                f"overflow {self.name!r} keeps the first {self.sinks} tokens: that leaves "
                f"nothing to evict in a context of {s.limit}. Reduce overflow.n_keep.",
                code="invalid_overflow",
            )
        return Fits()

    def keep_when_full(self, limit: int) -> int:
        rest = limit - self.sinks
        discard = min(self.n_discard or rest // 2, rest - 1)
        keep = limit - max(discard, 1)
        return min(keep, self.budget) if self.budget else keep

    def on_full(self, s: ContextState) -> Finish | Evict:
        if s.max_tokens is None:
            return Finish()
        keep = self.keep_when_full(s.limit)
        evicted = s.limit - 1 - keep  # the cache holds limit - 1 tokens when it is full
        if s.max_dropped is not None and s.dropped + evicted > s.max_dropped:
            return Finish()
        return Evict(keep)

    def over_budget(
        self, cached: int, decoding: bool, prompt_done: bool, block_size: int
    ) -> Evict | None:
        if not self.budget or not prompt_done or cached <= self.budget:
            return None
        if decoding and cached < self.budget + block_size:
            return None
        return Evict(self.budget)

    def score_from(self, prompt_len: int) -> int | None:
        # SnapKV: the prompt's last ``window`` queries, then every one since the last eviction
        # (the runner clears its scores when it evicts); H2O: every query; key norms: none.
        if self.name == "snapkv":
            return max(0, prompt_len - max(self.window, 1))
        return 0 if self.name == "h2o" else None


def context_policy(choice: ContextOverflow) -> ContextPolicy:
    keep = DEFAULT_KEEP if choice.n_keep is None else choice.n_keep
    if choice.policy in IMPORTANCE_POLICIES:
        return ImportancePolicy(
            choice.policy,
            choice.sinks,
            DEFAULT_WINDOW if choice.window is None else choice.window,
            choice.kv_budget or 0,
            choice.n_discard,
            choice.selection != "layer",
        )
    if choice.policy == "error":
        return ErrorPolicy()
    if choice.policy == "stop":
        return StopPolicy()
    if choice.policy == "truncate":
        return TruncatePolicy(keep)
    if choice.policy == "shift":
        return ShiftPolicy(keep, choice.n_discard)
    return SinkPolicy(keep, choice.n_discard)
