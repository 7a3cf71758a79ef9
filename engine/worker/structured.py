"""Structured outputs: llguidance compiles each request's constraint (JSON schema, regex,
choice, GBNF or Lark grammar) and keeps one matcher per request; before sampling, the rows of
constrained requests get the matcher's token mask, and each sampled token advances its matcher.

llguidance releases the GIL while it fills masks, so they are filled in a worker thread while
the step's forward pass runs. Requests without a constraint never touch this module.

A constraint is compiled once, at admission, in a compile thread and under a time limit (a
schema can take seconds); the engine thread copies that compiled matcher for each request
rather than compiling it again, which would stall every stream for as long.

What a constraint cannot do is found as early as it can be: at admission, what fails to compile
or fails in the steps every output takes (``Compiled.length``); while sampling, a matcher that
fails or a mask that ``min_tokens`` empties ends that request alone with a RequestError.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from engine.core.errors import RequestError
from engine.core.sampling_params import Constraint, SamplingParams
from engine.worker.finite_instance import has_finite_instance

# Our constraint kinds as llguidance's grammar formats.
FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}

# Compiled constraints kept for reuse, newest last. Bounded twice: by count, and by the size of
# their source text, since a compiled grammar costs memory in proportion to it (measured: a
# 300 KiB schema compiles to ~21 MiB, a one-property one to ~64 KiB), so a run of distinct
# schemas never grows memory without bound. 64 covers every request between its admission and
# the engine thread's first step (the hand-off this cache is for) with room for repeats.
CACHE_SIZE = 64
CACHE_TEXT_BYTES = 8 << 20
# Threads that compile constraints for admission: llguidance drops the GIL while it compiles, so
# this many cores at most go to compiling, however many slow schemas arrive at once.
COMPILE_THREADS = 2
# Steps of a constraint's forced start that admission walks (see ``_forced_start``): each costs
# a mask, mostly well under a millisecond.
FORCED_STEPS = 16
NO_FINITE_INSTANCE = (
    "no instance of the schema is finite: each must contain another (a $ref to itself that "
    "is required, or nothing but that $ref)."
)


@dataclass(frozen=True)
class Compiled:
    """One constraint's compilation: a matcher in its start state to copy, or the error."""

    matcher: llguidance.LLMatcher | None
    error: str
    seconds: float  # how long it took, so a cached slow one is refused like a fresh one
    # Every output is this many tokens and then its end, when the constraint forces them all
    # from the start; None when it branches first (or later than FORCED_STEPS).
    length: int | None = None


class Grammars:
    """Compiled constraints and per-request matchers over one tokenizer."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        # Requests whose constraint is complete and ended by a stop token; with ignore_eos they
        # go on generating, unconstrained.
        self.ended: set[str] = set()
        # Requests whose constraint failed on the engine thread, and why (``refusal``).
        self.refused: dict[str, RequestError] = {}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        # Admission (HTTP worker threads) and the engine thread share these.
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[tuple[str, str], Future] = {}  # one compile per key at a time
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kvserve-compile")

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.3 s): an engine that never sees a constraint never pays."""
        text = self.tokenizer_json.read_text("utf-8")
        return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    @functools.cached_property
    def executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor(num_threads=1)

    def admit(self, params: SamplingParams, limit_s: float | None = None) -> Compiled:
        """``params.structured`` compiled (``grammar``), refused also when it ends every output
        before ``params.min_tokens``: min_tokens would then ban all the constraint allows."""
        done = self.grammar(params.structured, limit_s)
        ends_early = done.length is not None and params.min_tokens > done.length
        # Ended, a constraint allows only EOS, which min_tokens holds back unless ignore_eos.
        if ends_early and set(params.held_back(self.eos_token_ids)) >= set(self.eos_token_ids):
            message = (
                f"min_tokens is {params.min_tokens}, but every output the "
                f"{params.structured.kind} allows ends after {done.length} tokens."
            )
            raise RequestError(message, param="min_tokens")
        return done

    def grammar(self, constraint: Constraint, limit_s: float | None = None) -> Compiled:
        """``constraint`` compiled (its ``matcher`` in its start state, not to be advanced);
        raises RequestError with llguidance's message if it is invalid, or with code
        ``grammar_too_complex`` if compiling it takes over ``limit_s`` seconds. Blocks the
        calling thread meanwhile, not the GIL."""
        key = (constraint.kind, constraint.value)
        with self._lock:
            done = self._cached(key)
            future = None
            if done is None:
                future = self._pending.get(key)
                if future is None:
                    future = self._compiler.submit(self._compile, key)
                    self._pending[key] = future
        if future is not None:
            try:
                done = future.result(timeout=limit_s)
            except (FutureTimeout, CancelledError):
                # Still queued: drop it. Already running: llguidance cannot be interrupted, and
                # its own size limits end it; what it compiles is cached and refused below.
                if future.cancel():
                    with self._lock:
                        self._pending.pop(key, None)
                raise self._too_complex(constraint, limit_s) from None
        if limit_s is not None and done.seconds > limit_s:
            raise self._too_complex(constraint, limit_s)
        if done.matcher is None:
            raise RequestError(f"Invalid {constraint.kind}: {done.error}", param=constraint.param)
        return done

    @staticmethod
    def _too_complex(constraint: Constraint, limit_s: float | None) -> RequestError:
        message = (
            f"The {constraint.kind} did not compile within {limit_s:g} s (the server's "
            "--max-grammar-compile-s); simplify it, e.g. fewer alternatives or properties."
        )
        return RequestError(message, param=constraint.param, code="grammar_too_complex")

    def _cached(self, key: tuple[str, str]) -> Compiled | None:
        """Under the lock: the compiled entry, now the newest, or None."""
        done = self._cache.get(key)
        if done is not None:
            self._cache.move_to_end(key)
        return done

    def _compile(self, key: tuple[str, str]) -> Compiled:
        start = time.perf_counter()
        kind, value = key
        try:
            grammar = llguidance.grammar_from(FORMATS[kind], value)
            if kind == "json" and not has_finite_instance(value):
                raise ValueError(NO_FINITE_INSTANCE)
        except ValueError as e:
            done = Compiled(None, str(e), time.perf_counter() - start)
        else:
            # Drops the GIL while it compiles; errors leave it in an error state.
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            error, length = (m.get_error(), None) if m.is_error() else self._forced_start(m)
            seconds = time.perf_counter() - start
            done = Compiled(None if error else m, _headline(error), seconds, length)
        with self._lock:
            self._pending.pop(key, None)
            if key not in self._cache:
                self._cache[key] = done
                self._cache_bytes += len(value)
            while len(self._cache) > 1 and (
                len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_TEXT_BYTES
            ):
                (_, old_value), _ = self._cache.popitem(last=False)
                self._cache_bytes -= len(old_value)
        return done

    def _forced_start(self, m: llguidance.LLMatcher) -> tuple[str, int | None]:
        """Walks a copy of ``m`` through the tokens its constraint forces from the start (a
        step's mask, then the one token it allows), for FORCED_STEPS at most: every request
        takes these steps, so what fails in them fails the constraint. llguidance builds its
        lexer as masks need it, so a pattern too large for the lexer compiles and fails only
        here. Returns llguidance's error (or ""), and ``Compiled.length``."""
        probe = m.deep_copy()
        bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        for steps in range(FORCED_STEPS + 1):
            llguidance.numpy.fill_next_token_bitmask(probe, bitmask, 0)
            if probe.is_error():
                error = _headline(probe.get_error())
                if steps == 0 and error in ("NoExtension", "NoExtensionBias"):  # stop reasons
                    return f"no text matches it (llguidance: {error}).", None
                return error, None
            allowed = allowed_tokens(bitmask[0], self.vocab_size)
            if not allowed:
                return "it allows no token at all", None
            if set(allowed) <= set(self.eos_token_ids):
                return "", steps
            if len(allowed) > 1:
                return "", None
            if not probe.consume_token(allowed[0]):
                return probe.get_error(), None
        return "", None

    def matcher(self, request_id: str, constraint: Constraint) -> llguidance.LLMatcher:
        m = self.matchers.get(request_id)
        if m is None:
            # A copy of the compiled start state: admission compiled it, so this costs
            # microseconds on the engine thread. Compiles here only if it left the cache since.
            with self._lock:
                done = self._cached((constraint.kind, constraint.value))
            if done is None:
                done = self._compile((constraint.kind, constraint.value))
            if done.matcher is None:
                raise RequestError(f"Invalid {constraint.kind}: {done.error}", constraint.param)
            m = done.matcher.deep_copy()
            self.matchers[request_id] = m
        return m

    def refusal(self, request_id: str, constraint: Constraint) -> RequestError | None:
        """Why the request's constraint cannot go on, or None: its matcher failed to start or
        failed since (at its last mask or token)."""
        refused = self.refused.get(request_id)
        m = self.matchers.get(request_id)
        if refused is None and m is not None and m.is_error():
            message = f"The {constraint.kind} cannot go on: {_headline(m.get_error())}"
            refused = self.refused[request_id] = RequestError(message, param=constraint.param)
            # The copies of one compilation share its lexer, and a lexer past its limits fails
            # them all: the next request compiles the constraint afresh.
            with self._lock:
                if self._cache.pop((constraint.kind, constraint.value), None) is not None:
                    self._cache_bytes -= len(constraint.value)
        return refused

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.refused.pop(rid, None)
            self.ended.discard(rid)

    def fill_async(
        self, requests: list[tuple[str, Constraint]], drafts: list[list[int]] | None = None
    ) -> Future:
        """Starts filling the next-token masks of ``requests``, one row each, or with
        ``drafts`` one row per draft more (the masks after each draft: llguidance advances the
        matcher through them and rolls it back). The future's result is an int32 bitmask
        [rows, ceil(V / 32)], bit set = token allowed."""
        drafts = drafts or [[] for _ in requests]
        rows, n = [], 0
        for (rid, c), d in zip(requests, drafts):
            if rid not in self.ended and rid not in self.refused:
                try:
                    rows.append((self.matcher(rid, c), n, d))
                except RequestError as e:  # this request's alone: ``refusal`` says it
                    self.refused[rid] = e
            n += len(d) + 1
        return self.worker.submit(self._fill, rows, n)

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], n: int) -> np.ndarray:
        bitmask = llguidance.numpy.allocate_token_bitmask(n, self.vocab_size)  # all allowed
        drafted = [row for row in rows if row[2]]  # llguidance refuses empty drafts
        plain = [(m, i) for m, i, d in rows if not d]
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self.executor, drafted, bitmask
            )
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, plain, bitmask)
        return bitmask

    def accept(self, request_id: str, constraint: Constraint, token_id: int) -> None:
        """Advances the request's matcher by its sampled token."""
        if request_id in self.ended:
            return
        m = self.matchers[request_id]
        if not m.consume_token(token_id):
            raise self.refusal(request_id, constraint) or RuntimeError(
                f"the constraint refused token {token_id}: {_headline(m.get_error())}"
            )
        if token_id in self.eos_token_ids:
            self.ended.add(request_id)


def _allowed_bits(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """A mask row (int32 words, bit set = allowed) as one byte per token, 1 = allowed."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]


def allowed_tokens(row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids a mask row allows."""
    return np.flatnonzero(_allowed_bits(row, vocab_size)).tolist()


def allows_any_but(row: np.ndarray, banned: list[int], vocab_size: int) -> bool:
    """Whether a mask row allows some token outside ``banned``."""
    bits = _allowed_bits(row, vocab_size)
    bits[[t for t in banned if 0 <= t < vocab_size]] = 0
    return bool(bits.any())


def _headline(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.split("\n<state>", 1)[0].strip()


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Sets the logits of disallowed tokens to -inf, in place (rows of ``logits`` match the
    bitmask's rows)."""
    words = torch.from_numpy(bitmask).to(logits.device)
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
