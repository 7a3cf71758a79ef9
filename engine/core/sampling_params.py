"""Per-request sampling and stopping options, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.core.context_overflow import ContextOverflow
from engine.core.errors import RequestError

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would
# overflow them.
GREEDY_BELOW = 1e-5
# repetition_penalty divides or multiplies a logit: within these a logit grows at most 100-fold,
# so a model's fp32 logits stay finite (the sampler then scales by 1/temperature overflow-free).
REPETITION_PENALTY = (0.01, 2.0)
INT64 = (-(2**63), 2**63 - 1)


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the generated text must match this.

    ``kind`` json: ``value`` is a JSON schema; regex: a regular expression; choice: a JSON list
    of strings; grammar: a GBNF (llama.cpp) or Lark grammar. ``param`` names the request field
    it came from, for error messages.
    """

    kind: str
    value: str
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            message = f"A constraint is one of {', '.join(CONSTRAINT_KINDS)}; got {self.kind!r}."
            raise RequestError(message, param=self.param)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k: chosen token plus k alternatives
    # None: off; k: each prompt token's logprob plus k alternatives (vLLM's extension).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's
    overflow: ContextOverflow | None = None  # None: the engine's default context policy
    structured: Constraint | None = None  # None: unconstrained
    # Teacher forcing: the output is these tokens, in order, whatever the model prefers; with
    # ``logprobs`` each is scored by the model (the perplexity of a text under a context policy).
    forced: tuple[int, ...] = ()
    # With a speculative server: False decodes this request one token per step.
    speculate: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "forced", tuple(self.forced))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")  # fmt: skip
        seed_ok = self.seed is None or INT64[0] <= self.seed <= INT64[1]
        checks = [
            *((math.isfinite(getattr(self, f)), f, "must be a finite number") for f in floats),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be non-negative"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1 (off), 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (
                REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1],
                "repetition_penalty",
                f"must be in [{REPETITION_PENALTY[0]}, {REPETITION_PENALTY[1]}]",
            ),
            (seed_ok, "seed", "must be a 64-bit signed integer"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (all(t >= 0 for t in self.forced), "forced", "must be token ids"),
            (
                not self.forced or self.max_tokens == len(self.forced),
                "max_tokens",
                "must be the number of forced tokens",
            ),
            (not (self.forced and self.structured), "forced", "excludes a structured output"),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
            (
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
                "logit_bias",
                "must map token ids to biases in [-100, 100]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                value = getattr(self, param)
                raise RequestError(f"{param} {message}, got {value!r}.", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def held_back(self, eos_token_ids: tuple[int, ...] | list[int]) -> list[int]:
        """The tokens ``min_tokens`` bans until it is reached: the stop token ids, and EOS
        unless ``ignore_eos``."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_token_ids))
