"""Structured outputs: llguidance compiles each request's constraint (JSON schema, regex,
choice, GBNF or Lark grammar) and keeps one matcher per request; before sampling, the rows of
constrained requests get the matcher's token mask, and each sampled token advances its matcher.

llguidance releases the GIL while it fills masks, so they are filled in a worker thread while
the step's forward pass runs. Requests without a constraint never touch this module.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from engine.core.errors import RequestError
from engine.core.sampling_params import Constraint

# Our constraint kinds as llguidance's grammar formats.
FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


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

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.3 s): an engine that never sees a constraint never pays."""
        text = self.tokenizer_json.read_text("utf-8")
        return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    @functools.cached_property
    def executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor(num_threads=1)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one Grammars per engine, kept for its life
    def grammar(self, constraint: Constraint) -> str:
        """llguidance's grammar for ``constraint``; raises RequestError with its message."""
        try:
            grammar = llguidance.grammar_from(FORMATS[constraint.kind], constraint.value)
        except ValueError as e:
            raise RequestError(f"Invalid {constraint.kind}: {e}", param=constraint.param) from e
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(f"Invalid {constraint.kind}: {error}", param=constraint.param)
        return grammar

    def matcher(self, request_id: str, constraint: Constraint) -> llguidance.LLMatcher:
        m = self.matchers.get(request_id)
        if m is None:
            m = llguidance.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
            self.matchers[request_id] = m
        return m

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.ended.discard(rid)

    def fill_async(self, requests: list[tuple[str, Constraint]]) -> Future:
        """Starts filling the next-token masks of ``requests`` (one row each); the future's
        result is an int32 bitmask [n, ceil(V / 32)], bit set = token allowed."""
        rows = [
            (self.matcher(rid, c), i)
            for i, (rid, c) in enumerate(requests)
            if rid not in self.ended
        ]
        return self.worker.submit(self._fill, rows, len(requests))

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], n: int) -> np.ndarray:
        bitmask = llguidance.numpy.allocate_token_bitmask(n, self.vocab_size)  # all allowed
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, rows, bitmask)
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
