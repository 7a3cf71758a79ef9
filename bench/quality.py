"""What a context-overflow policy and a KV cache dtype cost in quality: the perplexity of a long
text read through a context that overflows, under each policy (``kvserve tune --objective
quality``), and how far each run's next-token distributions are from the float32-KV,
full-context run's.

The text is scored teacher-forced through the engine, with the policy in effect exactly as in
serving: its first ``max_model_len - chunk`` tokens are a prompt (scored with prompt logprobs),
the rest is output the request is forced to produce (``SamplingParams.forced``, each token
scored with its logprob). So the scheduler fills the context and asks the request's context
policy, as it does for a generating request:

- ``shift`` / ``sink``: one request; every time the context fills, the policy drops tokens and
  the cached keys are re-rotated, then scoring goes on.
- ``truncate`` acts when a prompt is admitted: the text is read as a conversation that resends
  everything so far, one request per ``chunk`` tokens; each is truncated to fit (keeping the
  first ``n_keep``) and scores its chunk. The context is rebuilt every time (StreamingLLM's
  "sliding window with re-computation").
- ``window`` is ``sink`` without sinks (``n_keep`` 0): the plain window that StreamingLLM shows
  blowing up once the first tokens leave the cache.
- ``snapkv`` / ``h2o`` / ``knorm``: one request; the cache keeps the tokens the policy judges
  important, evicting half of the context whenever it fills, or, with a ``kv_budget``, down to
  the budget at the end of the prompt and every block after.
- ``full``: the whole text in one context, the reference line.

Every policy predicts the same tokens (all but the first), so perplexities compare directly;
"after overflow" counts the tokens from position ``max_model_len`` on, the first predicted from
a context the policy has changed.

Beside perplexity, as llama.cpp's ``llama-perplexity --kl-divergence`` does: for every
predicted token, the KL divergence KL(P_ref || P) of the run's whole next-token distribution P
from the reference's, and whether their most likely tokens agree (top-1). The reference is the
same text and model read in one context with a float32 KV cache (``reference_run``). The API's
logprobs hold the top k at most, so the rows' logits are taken inside the process, where the
engine computes them (``tap_rows``). ``kv_dtype_costs`` gives a KV dtype's cost alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import re
import tarfile
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.context_overflow import (
    IMPORTANCE_POLICIES,
    SCORED_POLICIES,
    ContextOverflow,
    round_up,
)
from engine.core.outputs import RequestOutput
from models.fetch import cache_root
from models.kv_spec import int4_keys

DEFAULT_CHUNK = 64
SMOOTHING = 64  # tokens per point of the plotted curve (a moving average of the NLL)
REFERENCE_KV = "float32"
# A captured row's token logprob against the engine's own for it: the same logits give the
# same value, so a larger gap means a row was matched to the wrong position.
ROW_CHECK_TOLERANCE = 1e-3

# Long public-domain texts that ship inside PyPI packages: name -> (sdist, sha256, member).
TEXTS = {
    "alice": (
        "https://files.pythonhosted.org/packages/6f/04/a3d3c4b94a35586ddb97c6a3c508913159161cd5"
        "58b34f315b382b924bf7/wordcloud-1.9.6.tar.gz",
        "df17c468ff903bd0aba4f87c6540745d13a4931220dd4937cb363ad85a4771b9",
        "wordcloud-1.9.6/examples/alice.txt",
    ),
}
GUTENBERG = re.compile(r"\*\*\* START OF.*?\*\*\*(.*)\*\*\* END OF", re.S)


@dataclass(frozen=True)
class Policy:
    label: str
    overflow: ContextOverflow | None  # None: the whole text in one context


def policy_grid(
    n_keep: Sequence[int], n_discard: Sequence[int | None], kv_budgets: Sequence[int] = (0,)
) -> list[Policy]:
    """Every policy that goes on past a full context: truncate and sink for each ``n_keep``
    (sink with 0 is the window without sinks), shift for each ``n_keep`` and ``n_discard``, and
    each importance policy at each of ``kv_budgets`` (0: none, it evicts when the context fills)."""
    points = []
    for keep in n_keep:
        points.append(Policy(f"truncate n_keep={keep}", ContextOverflow("truncate", keep)))
        for discard in n_discard:
            label = f"shift n_keep={keep}" + ("" if discard is None else f" n_discard={discard}")
            points.append(Policy(label, ContextOverflow("shift", keep, discard)))
        label = "window (no sinks)" if keep == 0 else f"sink n_keep={keep}"
        points.append(Policy(label, ContextOverflow("sink", keep)))
    for name in IMPORTANCE_POLICIES:
        for budget in kv_budgets:
            label = name + (f" kv_budget={budget}" if budget else "")
            points.append(Policy(label, ContextOverflow(name, kv_budget=budget)))
    return points


def _params(forced: Sequence[int], overflow: ContextOverflow | None, prompt: bool):
    return SamplingParams(
        max_tokens=len(forced) or 1,
        temperature=0,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0 if prompt else None,
        overflow=overflow,
        forced=tuple(forced),
    )


def score_requests(
    tokens: Sequence[int], overflow: ContextOverflow, limit: int, chunk: int
) -> list[tuple[list[int], SamplingParams]]:
    """The requests whose logprobs, in order, predict ``tokens[1:]`` under ``overflow`` with a
    context of ``limit``: (prompt, params) each."""
    first = limit - chunk  # the first prompt, scored with prompt logprobs
    if first < 2:
        raise ValueError(f"--chunk {chunk} leaves no prompt in a context of {limit}")
    if len(tokens) <= limit:
        raise ValueError(f"the text has {len(tokens)} tokens: it must overflow {limit}")
    if overflow.policy != "truncate":
        return [(list(tokens[:first]), _params(tokens[first:], overflow, prompt=True))]
    requests = [(list(tokens[:first]), _params(tokens[first:limit], overflow, prompt=True))]
    for start in range(limit, len(tokens), chunk):
        forced = tokens[start : start + chunk]
        requests.append((list(tokens[:start]), _params(forced, overflow, prompt=False)))
    return requests


def scored_logprobs(outputs: Sequence[RequestOutput]) -> list[float]:
    """The logprobs a policy's requests assigned, in text order (prompt ones first)."""
    values = []
    for out in outputs:
        if out.prompt_logprobs is not None:
            values += [lp.logprob for lp in out.prompt_logprobs[1:]]
        completion = out.outputs[0]
        if completion.finish_reason != "length" or completion.logprobs is None:
            raise RuntimeError(f"scoring request {out.request_id} ended early: {completion}")
        values += [lp.logprob for lp in completion.logprobs]
    return values


@dataclass(frozen=True)
class Divergence:
    """A run's next-token distributions against the reference's, over some predicted tokens."""

    rows: int
    kld_mean: float  # KL(P_ref || P) in nats
    kld_median: float
    kld_p99: float
    kld_max: float
    top1: float  # the share of rows whose most likely token is the reference's

    @classmethod
    def of(cls, kld: np.ndarray, top1: np.ndarray) -> Divergence | None:
        """Over the rows compared (not NaN); None when there are none."""
        seen = ~np.isnan(kld)
        if not seen.any():
            return None
        k = kld[seen]
        return cls(
            int(seen.sum()),
            float(k.mean()),
            float(np.median(k)),
            float(np.percentile(k, 99)),
            float(k.max()),
            float(top1[seen].mean()),
        )


@dataclass
class QualityResult:
    policy: Policy
    logprobs: list[float]  # of tokens[1:]
    limit: int  # max_model_len; the first token predicted after an overflow is at this index
    kv_dtype: str = ""  # the KV cache's, resolved ("" where not known)
    # Per entry of logprobs, against the reference: KL(P_ref || P), and 1.0 where the most
    # likely tokens agree (else 0.0); NaN where not compared. None: no reference.
    kld: np.ndarray | None = None
    top1: np.ndarray | None = None

    @property
    def nll(self) -> np.ndarray:
        return -np.asarray(self.logprobs, dtype=np.float64)

    @property
    def ppl(self) -> float:
        return float(math.exp(self.nll.mean()))

    @property
    def ppl_after(self) -> float:
        """Perplexity of the tokens at positions max_model_len and later."""
        return float(math.exp(self.nll[self.limit - 1 :].mean()))

    def divergence(self, start: int = 1, stop: int | None = None) -> Divergence | None:
        """Against the reference, over the tokens predicted at positions ``start`` to
        ``stop - 1`` (default: to the end); None where none was compared."""
        if self.kld is None:
            return None
        rows = slice(start - 1, None if stop is None else stop - 1)
        return Divergence.of(self.kld[rows], self.top1[rows])

    @property
    def divergence_after(self) -> Divergence | None:
        """Over the tokens at positions max_model_len and later."""
        return self.divergence(self.limit)


@dataclass
class Reference:
    """The float32-KV, full-context run of a text: its scores, and its next-token
    log-distributions (log-softmax over the whole vocabulary) at ``positions`` (position p:
    the row that predicts token p from tokens[:p]), on the host."""

    result: QualityResult
    positions: range
    logprobs: torch.Tensor  # [len(positions), vocab] float32
    args: EngineArgs  # the run's settings

    def repeats(self, args: EngineArgs) -> bool:
        """Whether reading the text in one context with ``args`` is the reference run again."""
        same = dataclasses.replace(args, kv_cache_dtype=REFERENCE_KV) == self.args
        return same and args.runner_config().kv_dtype == REFERENCE_KV

    def twin(self, policy: Policy, limit: int) -> QualityResult:
        """The reference's own scores under another label: no divergence at its positions."""
        kld, top1 = (np.full(len(self.result.logprobs), np.nan) for _ in range(2))
        rows = slice(self.positions.start - 1, self.positions.stop - 1)
        kld[rows], top1[rows] = 0.0, 1.0
        return QualityResult(policy, self.result.logprobs, limit, self.result.kv_dtype, kld, top1)


def kl_rows(ref: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of two log-distributions [n, V]: KL(P_ref || Q) in nats, and whether their most
    likely tokens agree."""
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - logq), 0.0)  # 0 log 0 = 0
    return terms.sum(-1), ref.argmax(-1) == logq.argmax(-1)


class RowSink:
    """Takes one run's rows of logits as the engine computes them (``tap_rows``) and keeps,
    per predicted position of ``positions``, only numbers: its token's logprob (to check the
    rows against the engine's own logprobs), and against ``reference`` the row's KLD and
    top-1 agreement. With ``keep`` (the reference run) it keeps the rows themselves too:
    float32 log-softmax rows on the host, 4 bytes per vocabulary entry, so 1.2 GB for 2000
    rows of a 152k vocabulary (Qwen2.5): a few thousand rows at most."""

    def __init__(
        self,
        tokens: Sequence[int],
        positions: range,
        reference: Reference | None = None,
        keep: bool = False,
    ):
        if not positions or positions.step != 1 or positions.start < 1:
            raise ValueError(f"rows {positions}: a range of positions from 1 on")
        if positions.stop > len(tokens):
            raise ValueError(f"rows {positions}: the text has {len(tokens)} tokens")
        if reference is not None and not _within(positions, reference.positions):
            raise ValueError(f"rows {positions}: the reference has {reference.positions}")
        self.tokens = torch.tensor(list(tokens))
        self.positions = positions
        self.reference = reference
        self.kept = None if not keep else torch.empty(0)
        n = len(tokens) - 1
        self.logprob, self.kld, self.top1 = (np.full(n, np.nan) for _ in range(3))

    def __call__(self, positions: list[int], logits: torch.Tensor) -> None:
        """Rows of ``logits`` [n, V] and the position each predicts. The first row of a
        position counts, as the engine's prompt logprobs do: a sequence recomputed after
        preemption predicts its prompt again, and the runner scores a shifted sequence's
        decode rows as prompt rows too where its context position falls inside the prompt
        (the engine drops those)."""
        chosen = [
            i
            for i, p in enumerate(positions)
            if p in self.positions and math.isnan(self.logprob[p - 1])
        ]
        if not chosen:
            return
        at = [positions[i] for i in chosen]
        rows = torch.log_softmax(logits[torch.tensor(chosen, device=logits.device)].float(), -1)
        index = np.asarray(at) - 1
        tokens = self.tokens[at].to(rows.device)
        self.logprob[index] = rows.gather(1, tokens[:, None])[:, 0].double().cpu().numpy()
        if self.kept is not None:
            if not self.kept.numel():
                self.kept = torch.empty(len(self.positions), rows.shape[1])
            self.kept[torch.tensor(at) - self.positions.start] = rows.cpu()
        if self.reference is not None:
            offsets = torch.tensor(at) - self.reference.positions.start
            kld, top1 = kl_rows(self.reference.logprobs[offsets].to(rows.device), rows)
            self.kld[index] = kld.double().cpu().numpy()
            self.top1[index] = top1.double().cpu().numpy()

    def check(self, logprobs: Sequence[float]) -> None:
        """Raises unless every position was seen and its token's logprob is ``logprobs``' (the
        engine's, of tokens[1:])."""
        index = np.arange(self.positions.start, self.positions.stop) - 1
        got = self.logprob[index]
        missing = int(np.isnan(got).sum())
        if missing:
            raise RuntimeError(f"{missing} rows of positions {self.positions} were not captured")
        gap = float(np.abs(got - np.asarray(logprobs, dtype=np.float64)[index]).max())
        if gap > ROW_CHECK_TOLERANCE:
            raise RuntimeError(f"captured rows differ from the engine's logprobs by {gap:.3g}")


def _within(inner: range, outer: range) -> bool:
    return outer.start <= inner.start and inner.stop <= outer.stop


Sink = Callable[[list[int], torch.Tensor], None]


class _Tap:
    """The wrappers ``tap_rows`` puts on one offline engine's objects (their own attributes,
    so other engines in the process are untouched)."""

    def __init__(self, llm: LLM, sinks: Sequence[Sink]):
        self.sinks = list(sinks)
        self.owners: dict[str, tuple[Sink, int]] = {}  # request id -> sink, prompt length
        self.pending: list[tuple[Sink | None, int]] | None = None  # a step's prompt rows
        runner = llm.engine.runner
        self.targets = [
            (llm.engine, "add_request"),
            (runner, "_prompt_logprobs"),
            (runner.model, "compute_logits"),
            (runner.sampler, "verify"),
        ]
        self.originals = {name: getattr(obj, name) for obj, name in self.targets}
        self.shadowed = {name: name in vars(obj) for obj, name in self.targets}

    def install(self) -> None:
        for obj, name in self.targets:
            setattr(obj, name, getattr(self, name))

    def remove(self) -> None:
        for obj, name in self.targets:
            if self.shadowed[name]:
                setattr(obj, name, self.originals[name])
            else:
                delattr(obj, name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], *args, **kwargs):
        if len(self.owners) == len(self.sinks):
            raise RuntimeError(f"more requests than the {len(self.sinks)} sinks")
        self.owners[request_id] = (self.sinks[len(self.owners)], len(prompt_token_ids))
        return self.originals["add_request"](request_id, prompt_token_ids, *args, **kwargs)

    def _prompt_logprobs(self, hidden: torch.Tensor, sched: list) -> dict:
        """The engine's, with each prompt row's logits passed on as ``compute_logits`` makes
        them, a slice at a time, in the order of its loop: the plan is checked after."""
        plan = [(s.request_id, _prompt_positions(s)) for s in sched]
        plan = [(rid, rows) for rid, rows in plan if rows]
        self.pending = [(self.owners.get(rid, (None, 0))[0], p) for rid, rows in plan for p in rows]
        try:
            out = self.originals["_prompt_logprobs"](hidden, sched)
            left = len(self.pending)
        finally:
            self.pending = None
        done = [(rid, range(first, first + len(records))) for rid, (first, records) in out.items()]
        if left or done != plan:
            raise RuntimeError(f"prompt rows: expected {plan}, the engine computed {done}")
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.originals["compute_logits"](hidden)
        if self.pending is not None:
            n = logits.shape[0]
            if n > len(self.pending):
                raise RuntimeError("more prompt rows of logits than the step scores")
            _feed(self.pending[:n], logits)
            del self.pending[:n]
        return logits

    def verify(self, logits, request_ids, params, prompt_ids, output_ids, drafts, *rest):
        """A forced token's row predicts the text at its prompt's length plus the tokens
        forced before it; rows of drafts are not scored."""
        entries = []
        for rid, p, out, d in zip(request_ids, params, output_ids, drafts):
            sink, start = self.owners.get(rid, (None, 0))
            if d or len(out) >= len(p.forced):
                sink = None
            entries += [(sink, start + len(out))] * (len(d) + 1)
        _feed(entries, logits)
        return self.originals["verify"](
            logits, request_ids, params, prompt_ids, output_ids, drafts, *rest
        )


def _prompt_positions(s) -> range:
    """The prompt tokens whose logprobs a step's scheduled sequence computes, as
    ``ModelRunner._prompt_logprobs`` counts them (row p predicts token p + 1)."""
    if s.params.prompt_logprobs is None:
        return range(0)
    m = min(len(s.token_ids), len(s.prompt_token_ids) - 1 - s.start_pos)
    return range(s.start_pos + 1, s.start_pos + 1 + max(m, 0))


def _feed(entries: Sequence[tuple[Sink | None, int]], logits: torch.Tensor) -> None:
    """Each sink its rows of ``logits`` (entry i: row i's sink and position)."""
    sinks = {id(s): s for s, _ in entries if s is not None}
    for key, sink in sinks.items():
        rows = [i for i, (s, _) in enumerate(entries) if id(s) == key]
        mine = logits  # all the rows: no copy of a slice of logits
        if len(rows) < len(entries):
            mine = logits[torch.tensor(rows, device=logits.device)]
        sink([entries[i][1] for i in rows], mine)


@contextlib.contextmanager
def tap_rows(llm: LLM, sinks: Sequence[Sink]) -> Iterator[None]:
    """While open, every row of logits the offline engine ``llm`` scores goes, before the
    engine reduces it to logprobs, to the sink of its request (the i-th request added to
    ``sinks[i]``) with the text position whose token it predicts: the prompt rows of requests
    that ask for prompt logprobs (their prompt is the start of the text) and the rows of
    forced tokens (the first at the prompt's length). The sampler and the logprobs are the
    engine's own; the rows are taken from its ``compute_logits`` and its sampler's
    ``verify``, a position each, so a sink sees every row once per computation of it."""
    tap = _Tap(llm, sinks)
    tap.install()
    try:
        yield
    finally:
        tap.remove()


def engine_for(base: EngineArgs, max_model_len: int, sequences: int) -> LLM:
    """An offline engine of ``base``'s settings with room for ``sequences`` full contexts at
    once (unless the pool size was given) and no bound on how far a shift may go."""
    blocks = sequences * (round_up(max_model_len, base.block_size) // base.block_size + 1)
    sized = base.num_kv_blocks is not None or base.kv_cache_memory_gib is not None
    args = dataclasses.replace(
        base,
        max_model_len=max_model_len,
        num_kv_blocks=base.num_kv_blocks if sized else blocks,
        max_overflow_tokens=max(base.max_overflow_tokens, 1 << 30),
        max_queue_len=None,
        max_queued_tokens=None,
    )
    return LLM(**dataclasses.asdict(args))


def _generate(
    llm: LLM,
    requests: Sequence[tuple[list[int], SamplingParams]],
    sinks: Sequence[RowSink] | None,
    bar: tqdm,
) -> list[RequestOutput]:
    """``requests`` through ``llm``; with ``sinks`` (one per request), their rows to them."""

    def progress(delta: RequestOutput) -> None:
        prompt = len(delta.prompt_logprobs) - 1 if delta.prompt_logprobs else 0
        bar.update(len(delta.outputs[0].token_ids) + prompt)

    with tap_rows(llm, sinks) if sinks else contextlib.nullcontext():
        return llm.generate([p for p, _ in requests], [s for _, s in requests], progress)


def _result(
    policy: Policy, scored: list[float], limit: int, llm: LLM, sink: RowSink | None
) -> QualityResult:
    result = QualityResult(policy, scored, limit, llm.engine.runner.config.kv_dtype)
    if sink is not None:
        sink.check(scored)
        result.kld, result.top1 = sink.kld, sink.top1
    return result


def score(
    base: EngineArgs,
    tokens: Sequence[int],
    policies: Sequence[Policy],
    limit: int,
    chunk: int = DEFAULT_CHUNK,
    show_progress: bool = False,
    reference: Reference | None = None,
) -> list[QualityResult]:
    """Every policy's logprobs of ``tokens[1:]``: the context-limited ones together in one
    engine of ``max_model_len`` ``limit``, the full reference in one that holds the text.
    With ``reference`` (``reference_run`` of the same tokens), also each row's KLD and top-1
    agreement against it, over its positions."""
    bounded = [p for p in policies if p.overflow is not None]
    requests = [score_requests(tokens, p.overflow, limit, chunk) for p in bounded]
    bar = tqdm(
        total=(len(tokens) - 1) * len(policies),
        disable=not show_progress,
        unit="tok",
        desc="scoring",
    )

    def sink() -> RowSink | None:
        return None if reference is None else RowSink(tokens, reference.positions, reference)

    results = {}
    if bounded:
        sinks = [sink() for _ in bounded]
        flat = [r for reqs in requests for r in reqs]
        per_request = None if reference is None else [
            s for s, reqs in zip(sinks, requests) for _ in reqs
        ]  # fmt: skip
        keeps_scores = any(p.overflow.policy in SCORED_POLICIES for p in bounded)
        args = dataclasses.replace(base, kv_scores=True) if keeps_scores else base
        llm = engine_for(args, limit, min(len(flat), base.max_num_seqs))
        outputs = iter(_generate(llm, flat, per_request, bar))
        for policy, reqs, s in zip(bounded, requests, sinks):
            scored = scored_logprobs([next(outputs) for _ in reqs])
            results[policy] = _result(policy, scored, limit, llm, s)
        del llm
    for policy in policies:
        if policy.overflow is None:
            results[policy] = _score_full(base, tokens, policy, limit, reference, bar)
    bar.close()
    return [results[p] for p in policies]


def _score_full(
    base: EngineArgs,
    tokens: Sequence[int],
    policy: Policy,
    limit: int,
    reference: Reference | None,
    bar: tqdm,
) -> QualityResult:
    """The whole text in one context (the reference's own scores where this would repeat its
    run: the same rows again, a whole pass saved)."""
    if reference is not None and reference.repeats(base):
        bar.update(len(tokens) - 1)
        return reference.twin(policy, limit)
    sink = None if reference is None else RowSink(tokens, reference.positions, reference)
    llm = engine_for(base, len(tokens) + 1, 1)
    (full,) = _generate(llm, [_full_request(tokens)], sink and [sink], bar)
    return _result(policy, logprobs_of_prompt(full), limit, llm, sink)


def _full_request(tokens: Sequence[int]) -> tuple[list[int], SamplingParams]:
    return list(tokens), _params((), None, prompt=True)


def logprobs_of_prompt(out: RequestOutput) -> list[float]:
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def reference_run(
    base: EngineArgs,
    tokens: Sequence[int],
    positions: range | None = None,
    show_progress: bool = False,
) -> Reference:
    """``tokens`` read in one context with ``base``'s settings and a float32 KV cache: the
    reference, with its rows at ``positions`` (default all, 1 to len(tokens) - 1) kept."""
    positions = range(1, len(tokens)) if positions is None else positions
    keep = RowSink(tokens, positions, keep=True)
    args = dataclasses.replace(base, kv_cache_dtype=REFERENCE_KV)
    llm = engine_for(args, len(tokens) + 1, 1)
    bar = tqdm(total=len(tokens) - 1, disable=not show_progress, unit="tok", desc="reference")
    (full,) = _generate(llm, [_full_request(tokens)], [keep], bar)
    bar.close()
    result = _result(Policy("full context", None), logprobs_of_prompt(full), len(tokens), llm, None)
    keep.check(result.logprobs)
    return Reference(result, positions, keep.kept, args)


def score_kv_dtypes(
    base: EngineArgs,
    tokens: Sequence[int],
    kv_dtypes: Sequence[str],
    policies: Sequence[Policy],
    limit: int,
    chunk: int = DEFAULT_CHUNK,
    show_progress: bool = False,
) -> list[QualityResult]:
    """``score`` under each KV cache dtype (``--kv-cache-dtype`` values), all against one
    float32-KV full-context reference: dtype by dtype, each its policies (int4 keys: but
    eviction by importance, which they refuse)."""
    reference = reference_run(base, tokens, show_progress=show_progress)
    results = []
    for kv in kv_dtypes:
        args = dataclasses.replace(base, kv_cache_dtype=kv)
        taken = policies
        if int4_keys(kv):
            moves = {p for p in policies if p.overflow and p.overflow.policy in IMPORTANCE_POLICIES}
            taken = [p for p in policies if p not in moves]
        results += score(args, tokens, taken, limit, chunk, show_progress, reference)
    return results


@dataclass(frozen=True)
class KVDtypeCost:
    """What a KV cache dtype costs a text read in one context, over some predicted tokens."""

    kv_cache_dtype: str  # as asked
    kv_dtype: str  # resolved ("auto": the model's dtype)
    rows: int
    perplexity: float
    kld_mean: float  # KL(P_float32-KV || P) in nats
    kld_p99: float
    top1: float  # the share of rows whose most likely token is the float32-KV run's


def kv_settings(name: str) -> dict:
    """The engine settings a cache is named by: ``--kv-cache-dtype``, or ``DTYPE+N`` with the
    last N tokens kept beside it (``--kv-cache-recent-tokens``)."""
    kv, plus, recent = name.partition("+")
    if plus and not recent.isdigit():
        raise ValueError(f"{name!r}: a cache is DTYPE or DTYPE+N (recent tokens)")
    return dict(kv_cache_dtype=kv, kv_cache_recent_tokens=int(recent or 0))


def kv_dtype_costs(
    base: EngineArgs,
    tokens: Sequence[int],
    kv_dtypes: Sequence[str],
    rows: range | None = None,
) -> dict[str, KVDtypeCost]:
    """Per KV cache dtype (``--kv-cache-dtype`` values, or ``kv_settings``' names), ``tokens``
    read in one context (no
    overflow policy) with ``base``'s other settings: perplexity, mean and 99th-percentile KLD
    and top-1 agreement against the float32-KV run of the same tokens.

    ``rows``: the positions of the predicted tokens that count (token p predicted from
    tokens[:p]), default all (1 to len(tokens) - 1). llama-perplexity scores the second half
    of each context of n_ctx tokens: for one such chunk ``rows=range(n_ctx // 2 + 1, n_ctx)``.
    The reference keeps a float32 row of the vocabulary per position of ``rows``.
    """
    reference = reference_run(base, tokens, rows)
    costs = {}
    for kv in kv_dtypes:
        args = dataclasses.replace(base, **kv_settings(kv))
        r, cost = full_context_cost(args, tokens, reference)
        costs[kv] = KVDtypeCost(kv, r.kv_dtype, *cost)
    return costs


def full_context_cost(
    args: EngineArgs, tokens: Sequence[int], reference: Reference
) -> tuple[QualityResult, tuple[int, float, float, float, float]]:
    """``tokens`` read in one context with ``args``, against ``reference`` at its positions:
    the result, and (rows, perplexity, mean KLD, 99th-percentile KLD, top-1 agreement)."""
    (r,) = score(args, tokens, [Policy("full context", None)], len(tokens), reference=reference)
    positions = reference.positions
    d = r.divergence(positions.start, positions.stop)
    nll = r.nll[positions.start - 1 : positions.stop - 1]
    return r, (d.rows, float(math.exp(nll.mean())), d.kld_mean, d.kld_p99, d.top1)


# --- texts --------------------------------------------------------------------------------


def load_text(name_or_path: str, home: Path | None = None) -> str:
    """A file's text, or a named public-domain text (``alice``) fetched once from PyPI."""
    if name_or_path not in TEXTS:
        return Path(name_or_path).read_text(encoding="utf-8")
    target = cache_root(home) / "texts" / f"{name_or_path}.txt"
    if not target.exists():
        url, sha256, member = TEXTS[name_or_path]
        with urllib.request.urlopen(url, timeout=120) as response:
            data = response.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise RuntimeError(f"{url}: unexpected contents")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            raw = tar.extractfile(member).read().decode("utf-8-sig")
        body = GUTENBERG.search(raw)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((body.group(1) if body else raw).strip() + "\n", encoding="utf-8")
    return target.read_text(encoding="utf-8")


# --- report -------------------------------------------------------------------------------

HEADER = (
    "| KV cache | policy | perplexity | after overflow | vs full, after overflow | mean KLD | "
    "p99 KLD | top-1 % | mean KLD after overflow | top-1 % after overflow |"
)


def markdown_table(results: Sequence[QualityResult]) -> str:
    """One row per (KV dtype, policy); the ratio is to the full context of the same KV dtype,
    KLD (nats) and top-1 agreement against the float32-KV full context."""
    full = {r.kv_dtype: r for r in results if r.policy.overflow is None}
    lines = [HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ref = full.get(r.kv_dtype)
        ratio = f"{r.ppl_after / ref.ppl_after:.2f}x" if ref else "-"
        cells = [r.kv_dtype or "-", r.policy.label, f"{r.ppl:.2f}", f"{r.ppl_after:.2f}", ratio]
        cells += divergence_cells(r.divergence(), p99=True)
        cells += divergence_cells(r.divergence_after)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def divergence_cells(d: Divergence | None, p99: bool = False) -> list[str]:
    """Mean KLD (and its 99th percentile) and top-1 agreement in %, or dashes."""
    if d is None:
        return ["-"] * (3 if p99 else 2)
    cells = [format(d.kld_mean, ".3g")] + ([format(d.kld_p99, ".3g")] if p99 else [])
    return [*cells, f"{100 * d.top1:.2f}"]


def describe(model: str, tokens: int, limit: int, chunk: int, block_size: int) -> str:
    return (
        f"{Path(model).name}: {tokens} tokens through a context of {limit} (block {block_size}; "
        f"truncate resends every {chunk} tokens); perplexity of tokens 1..{tokens - 1}, and of "
        f"those from position {limit} on (after overflow); KLD (nats) of each next-token "
        f"distribution from the {REFERENCE_KV}-KV full-context run's, and how often their most "
        "likely tokens agree (top-1)"
    )


def _smooth(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A moving average over SMOOTHING rows, at the position of each window's last row."""
    k = min(SMOOTHING, len(values))
    smooth = np.convolve(values, np.ones(k) / k, mode="valid")
    return np.arange(len(smooth)) + k, smooth


def curve_figure(results: Sequence[QualityResult], limit: int) -> Figure:
    """NLL per position (a moving average), one line per (KV dtype, policy), and below it the
    KLD from the reference where there is one; the context limit marked."""
    kinds = list(dict.fromkeys(r.kv_dtype for r in results))
    policies = list(dict.fromkeys(r.policy.label for r in results))
    compared = [r for r in results if r.kld is not None]
    fig = Figure(figsize=(10, 9 if compared else 5.5))
    axes = fig.subplots(2 if compared else 1, 1, sharex=True, squeeze=False)[:, 0]
    dashes = ["-", "--", ":", "-."]
    for r in results:
        label = r.policy.label if len(kinds) == 1 else f"{r.kv_dtype} / {r.policy.label}"
        color = "black" if r.policy.overflow is None else f"C{policies.index(r.policy.label)}"
        style = dict(color=color, linestyle=dashes[kinds.index(r.kv_dtype) % len(dashes)])
        axes[0].plot(*_smooth(r.nll), label=f"{label} ({r.ppl_after:.1f})", lw=1.2, **style)
        if r.kld is not None:
            seen = ~np.isnan(r.kld)
            x, y = _smooth(r.kld[seen])
            axes[1].plot(np.flatnonzero(seen)[x - 1] + 1, y, lw=1.2, **style)
    for ax in axes:
        ax.axvline(limit, color="grey", linestyle=":", label=f"context full ({limit})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"NLL, mean over {SMOOTHING} tokens (nats)")
    axes[0].set_title("Per-token NLL by context policy (perplexity after overflow in brackets)")
    axes[0].legend(fontsize=7, loc="upper left", ncols=2 if len(results) > 8 else 1)
    if compared:
        if any(np.nanmax(r.kld, initial=0.0) > 0 for r in compared):
            axes[1].set_yscale("log", nonpositive="mask")  # the reference's own settings: 0
        axes[1].set_ylabel(f"KLD, mean over {SMOOTHING} tokens (nats)")
        axes[1].set_title(f"KL divergence from the {REFERENCE_KV}-KV full-context run")
    axes[-1].set_xlabel("position in the text (tokens)")
    fig.tight_layout()
    return fig


def _floats(values: np.ndarray | None) -> list[float | None] | None:
    """JSON has no NaN: rows not compared are null."""
    if values is None:
        return None
    return [None if math.isnan(v) else float(v) for v in values]


def result_dict(r: QualityResult) -> dict:
    d, after = r.divergence(), r.divergence_after
    return {
        "policy": r.policy.label,
        "kv_cache_dtype": r.kv_dtype,
        "overflow": dataclasses.asdict(r.policy.overflow) if r.policy.overflow else None,
        "perplexity": r.ppl,
        "perplexity_after_overflow": r.ppl_after,
        "divergence": dataclasses.asdict(d) if d else None,
        "divergence_after_overflow": dataclasses.asdict(after) if after else None,
        "logprobs": r.logprobs,
        "kld": _floats(r.kld),
        "top1": _floats(r.top1),
    }


def write_report(
    results: Sequence[QualityResult], description: str, limit: int, out_dir: str | Path
) -> list[Path]:
    """quality.md (the table), quality.json (every logprob, KLD and top-1 agreement) and
    quality.png (the curves)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "quality.md"
    md.write_text(f"{description}\n\n{markdown_table(results)}\n")
    data = out / "quality.json"
    rows = [result_dict(r) for r in results]
    data.write_text(json.dumps({"description": description, "max_model_len": limit,
                                "reference_kv_cache_dtype": REFERENCE_KV,
                                "results": rows}, allow_nan=False) + "\n")  # fmt: skip
    png = out / "quality.png"
    fig = curve_figure(results, limit)
    FigureCanvasAgg(fig)
    fig.savefig(png, dpi=100)
    return [md, data, png]
