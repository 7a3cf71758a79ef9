"""Speculative decoding, the scheduler's side: how many tokens each request drafts in a step,
and the n-gram proposer. Pure Python.

A speculating request is scheduled with its last sampled token and ``k`` draft slots. Before the
forward pass the proposer fills the slots (n-gram prompt lookup here; a draft model in
``engine.worker.drafter``), the target model computes all ``k + 1`` positions at once, and the
sampler keeps the drafts it accepts plus one token of its own (``Sampler.verify``). The
scheduler then gives the rejected drafts' slots back.

How long to draft (``DraftLength``) is a trade measured as it runs: a step computing ``r`` rows
costs about ``a + b r`` seconds (fitted over the recent decode steps), each drafted position
costs the proposer ``c`` seconds per sequence (a draft model's step), and a request whose
drafts are each accepted with probability ``p`` gets ``(1 - p^(k+1)) / (1 - p)`` tokens from a
step that drafts ``k``. The batch drafts the ``k`` that gives the most tokens per second, which
is 0 where a step is compute-bound. The model is checked against what it yields: per batch
size, the tokens per second of whole steps (drafting included) with drafts and without; where
drafting has yielded less, that batch size stops drafting (but for one step in
``EXPLORE_AFTER``, so that the figure stays current).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATIVE_METHODS = ("ngram", "draft_model")
# Prior acceptance of a request's drafts until its own is measured, and how fast the measured
# one follows (per verified step).
PRIOR_ACCEPTANCE = 0.6
ACCEPTANCE_WEIGHT = 0.3
PRIOR_WEIGHT = 0.05
# The step-cost fit forgets at this rate per step, so it follows a changing batch.
COST_DECAY = 0.98
# A step of r rows costs a (1 + PRIOR_ROW_COST r) until steps have been measured.
PRIOR_ROW_COST = 0.2
# A draft model further behind a request than this fell behind (it did not draft for it), rather
# than missing a step's accepted drafts.
LAG_TOKENS = 16
# A request whose acceptance is not measured yet drafts this many, whatever the estimates say:
# requests differ (a rewrite repeats its prompt, a question does not), so each is measured.
FIRST_DRAFTS = 3
# Where drafting yielded less than not drafting, one step in EXPLORE_AFTER drafts anyway.
EXPLORE_AFTER = 20
# Drafting stops where it has yielded below this share of not drafting: a margin for the noise
# of steps whose yield depends on how many drafts a rename or a new sentence cut short.
VETO = 0.9
# Tokens and seconds of a batch size's steps are summed with this decay per step of that batch
# size, their ratio the realized rate: a few steps' worth, not one lucky or unlucky step.
REALIZED_DECAY = 0.9


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` ngram or draft_model; ``num_tokens``: the most tokens drafted per step
    (None: adaptive up to ``max_tokens``); n-gram lookup matches the last
    ``ngram_min..ngram_max`` tokens."""

    method: str
    num_tokens: int | None = None
    max_tokens: int = 8
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}")
        if self.num_tokens is not None and not 1 <= self.num_tokens <= self.max_tokens:
            raise ValueError(f"num_speculative_tokens must be in [1, {self.max_tokens}]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram lookup needs 1 <= min <= max")

    @property
    def adaptive(self) -> bool:
        return self.num_tokens is None

    @property
    def most(self) -> int:
        return self.num_tokens or self.max_tokens


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the
    context's last n tokens (the longest n in ``n_max..n_min`` that occurs); [] if none does."""
    size = len(token_ids)
    if k <= 0 or size < n_min + 1:
        return []
    last = token_ids[-1]
    # Where the last token occurred before (each a match must end at), latest last.
    ends = [i for i, t in enumerate(token_ids[:-1]) if t == last]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = token_ids[size - n :]
        for i in reversed(ends):
            if i >= n - 1 and token_ids[i - n + 1 : i + 1] == tail:
                return token_ids[i + 1 : i + 1 + k]
    return []


def expected_tokens(p: float, k: int) -> float:
    """Tokens a step yields when each of ``k`` drafts is accepted with probability ``p``
    (the first rejection ends the run; the target adds one token either way)."""
    if p >= 1.0:
        return k + 1.0
    return (1.0 - p ** (k + 1)) / (1.0 - p)


@dataclass
class StepCost:
    """Seconds a decode step of r rows takes, a + b r, fitted by least squares over the
    measured steps with exponential forgetting."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def line(self) -> tuple[float, float]:
        """(a, b); the prior shape scaled to the mean step until rows have varied."""
        if self.n < 1:
            return 1.0, PRIOR_ROW_COST
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < 0.25:  # all steps had about the same rows: only the level is known
            a = my / (1 + PRIOR_ROW_COST * mx)
            return a, a * PRIOR_ROW_COST
        b = max(0.0, (self.sxy / self.n - mx * my) / var)
        return max(my - b * mx, 1e-6), b

    def seconds(self, rows: float) -> float:
        a, b = self.line()
        return a + b * rows


@dataclass
class DraftLength:
    """Chooses each step's draft length from measured costs and acceptance."""

    config: SpeculativeConfig
    cost: StepCost = field(default_factory=StepCost)
    draft_seconds: float = 0.0  # the proposer's cost per drafted position of one step
    # Acceptance over recent requests: where a new request's own estimate starts.
    prior: float = PRIOR_ACCEPTANCE
    steps: int = 0  # decode steps chosen for
    # Decayed sums of (tokens, seconds) of whole decode steps by (batch size, whether the
    # step drafted).
    sums: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)

    def choose(self, acceptance: list[float], room: list[int]) -> list[int]:
        """Drafts per request of a decode batch: ``acceptance`` its requests' measured rates,
        ``room`` the most each may draft (context, max_tokens)."""
        most = min(self.config.most, max(room, default=0))
        if not self.config.adaptive or most == 0:
            return [min(most, r) for r in room]
        chosen = self._best(acceptance, room, most)
        if any(chosen):
            # The model proposes, what steps yielded disposes: a batch size drafts once its
            # steps without drafts are measured, and stops where drafting has yielded less
            # (but for a step now and then, to see whether that still holds).
            batch = len(room)
            plain, drafting = self._rate(batch, False), self._rate(batch, True)
            self.steps += 1
            if plain is None or (
                drafting is not None and drafting < VETO * plain and self.steps % EXPLORE_AFTER
            ):
                chosen = [0] * batch
        return chosen

    def pays(self, batch: int) -> bool:
        """Whether drafting has yielded more than not drafting at this batch size (not yet
        measured: for a single stream only)."""
        plain, drafting = self._rate(batch, False), self._rate(batch, True)
        if plain is None or drafting is None:
            return batch == 1
        return drafting > plain

    def observe_yield(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of ``batch`` requests (``drafted``: with drafts) gave ``tokens`` in
        ``seconds``, drafting included."""
        # Both figures of the batch size age with every step of it, so that what a past
        # request's drafts yielded fades while the batch does not draft.
        for arm in (False, True):
            t, s = self.sums.get((batch, arm), (0.0, 0.0))
            new = (tokens, seconds) if arm == drafted else (0.0, 0.0)
            if s or arm == drafted:
                self.sums[batch, arm] = (REALIZED_DECAY * t + new[0], REALIZED_DECAY * s + new[1])

    def _rate(self, batch: int, drafted: bool) -> float | None:
        """Tokens per second realized at this batch size (with drafts or without), or None."""
        t, s = self.sums.get((batch, drafted), (0.0, 0.0))
        return t / s if s > 0 else None

    def _best(self, acceptance: list[float], room: list[int], most: int) -> list[int]:
        batch = len(acceptance)
        best, best_rate = 0, batch / self.cost.seconds(batch)
        for k in range(1, most + 1):
            tokens = sum(expected_tokens(p, min(k, r)) for p, r in zip(acceptance, room))
            rows = batch + sum(min(k, r) for r in room)
            seconds = self.cost.seconds(rows) + k * self.draft_seconds
            if tokens / seconds > best_rate:
                best, best_rate = k, tokens / seconds
        return [min(best, r) for r in room]

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def observe_drafting(self, positions: int, seconds: float) -> None:
        """The proposer ran ``positions`` one-token steps (a draft model's forward passes) in
        ``seconds``."""
        if positions:
            per, w = seconds / positions, ACCEPTANCE_WEIGHT
            old = self.draft_seconds or per
            self.draft_seconds = (1 - w) * old + w * per

    def observe_acceptance(self, rate: float | None, drafted: int, accepted: int) -> float:
        """A request's acceptance estimate (None: none yet) after a step that verified
        ``drafted`` drafts and kept ``accepted``: the rate per draft position reached,
        followed exponentially; the prior for new requests follows it more slowly."""
        current = self.prior if rate is None else rate
        if drafted == 0:
            return current
        # Positions tested: the accepted ones, plus the rejected one if any.
        tested = accepted + (accepted < drafted)
        observed = accepted / tested
        self.prior = (1 - PRIOR_WEIGHT) * self.prior + PRIOR_WEIGHT * observed
        return (1 - ACCEPTANCE_WEIGHT) * current + ACCEPTANCE_WEIGHT * observed
