"""Structured outputs: llguidance compiles each request's constraint (JSON schema, regex,
choice, GBNF or Lark grammar) and keeps one matcher per request; before sampling, the rows of
constrained requests get the matcher's token mask, and each sampled token advances its matcher.

llguidance releases the GIL while it fills masks, so they are filled in a worker thread while
the step's forward pass runs. Requests without a constraint never touch this module.

A constraint is compiled once, at admission, in a compile thread and under a time limit (a
schema can take seconds); the engine thread copies that compiled matcher for each request
rather than compiling it again, which would stall every stream for as long.
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
from engine.core.sampling_params import Constraint

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


@dataclass(frozen=True)
class Compiled:
    """One constraint's compilation: a matcher in its start state to copy, or the error."""

    matcher: llguidance.LLMatcher | None
    error: str
    seconds: float  # how long it took, so a cached slow one is refused like a fresh one


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

    def grammar(self, constraint: Constraint, limit_s: float | None = None) -> llguidance.LLMatcher:
        """``constraint`` compiled (a matcher in its start state, not to be advanced); raises
        RequestError with llguidance's message if it is invalid, or with code
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
        return done.matcher

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
        except ValueError as e:
            done = Compiled(None, str(e), time.perf_counter() - start)
        else:
            # Drops the GIL while it compiles; errors leave it in an error state.
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            error = m.get_error() if m.is_error() else ""
            done = Compiled(None if error else m, error, time.perf_counter() - start)
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

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
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
            if rid not in self.ended:
                rows.append((self.matcher(rid, c), n, d))
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

    def accept(self, request_id: str, token_id: int) -> None:
        """Advances the request's matcher by its sampled token."""
        if request_id in self.ended:
            return
        m = self.matchers[request_id]
        if not m.consume_token(token_id):
            raise RuntimeError(f"the constraint cannot continue: {m.get_error()}")
        if token_id in self.eos_token_ids:
            self.ended.add(request_id)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Sets the logits of disallowed tokens to -inf, in place (rows of ``logits`` match the
    bitmask's rows)."""
    words = torch.from_numpy(bitmask).to(logits.device)
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
