"""Incremental detokenization and stop strings, without emitting broken UTF-8."""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of ids into text deltas.

    Text is re-decoded over a short window (``prefix_offset:``) so that tokens whose text
    depends on their neighbours (byte-level pieces, SentencePiece spaces) come out right; a
    delta ending in an incomplete character is held back until the next token completes it.
    Text that might be the start of a stop string is held back too, until it is not.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text so far (truncated at a stop string)
        self.emitted = 0  # chars of self.text already handed out
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one now appears in the text."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return None
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at >= 0:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                return stop
        return None

    def flush(self) -> None:
        """At the end: keep whatever is left undecoded, replacement characters included."""
        rest = self._decode(self.ids[self.prefix_offset :])
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(rest) > len(prefix_text):
            self.text += rest[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)

    def take(self, finished: bool) -> str:
        """The text not handed out yet, holding back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
