"""The load tester behind `kvserve bench`, for OpenAI-compatible servers (kvserve, vLLM,
llama.cpp).

Programmatic use (the policy tuner drives it in-process)::

    result = await run_benchmark(BenchConfig(request_rate=4.0, num_prompts=50))
    result.summary.output_throughput, result.summary.ttft.p99_ms, result.to_dict()
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np
from tqdm import tqdm

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
SCRAPED_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
METRIC_PREFIXES = ("kvserve:", "vllm:")
# Older vLLM releases export the KV usage gauge under its GPU-only name.
GAUGE_ALIASES = {"gpu_cache_usage_perc": "kv_cache_usage_perc"}
ENDPOINT_PATHS = {
    "completions": "/completions",
    "chat": "/chat/completions",
    "responses": "/responses",
}
# The endpoints whose prompts are conversations, rendered by the server's chat template.
TEMPLATED_ENDPOINTS = ("chat", "responses")

# Frequent English words: nearly every BPE vocabulary holds each (with its leading space) as
# one token, so a prompt of N of them is close to N tokens without knowing the tokenizer.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first "
    "water been call who its now find long down day did get come made may part over new sound "
    "take only little work know place year live me back give most very after thing our just "
    "name good sentence man think say great where help through much before line right too mean "
    "old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land"
).split()


class BenchError(RuntimeError):
    """A benchmark that cannot start: refused target, no model, unreadable dataset."""


@dataclass(frozen=True)
class SLO:
    """Per-request service-level objectives; a request meets them all to count as goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def defined(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    @classmethod
    def parse(cls, text: str) -> SLO:
        """Parse ``ttft=MS,tpot=MS[,e2e=MS]`` (any subset)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO term {part!r}: expected ttft=MS, tpot=MS or e2e=MS")
            values[f"{key}_ms"] = float(value)
        return cls(**values)

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.success:
            return False
        if self.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1e3 > self.ttft_ms):
            return False
        # A one-token answer has no TPOT; it cannot miss that objective (as vLLM counts it).
        tpot = rec.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        e2e = rec.e2e_s
        return self.e2e_ms is None or (e2e is not None and e2e * 1e3 <= self.e2e_ms)


def normalize_base_url(url: str) -> str:
    """The OpenAI API root, ending in ``/v1``, from either convention users bring.

    vLLM's ``bench serve`` takes host and port only (``http://127.0.0.1:8000``) and adds the
    path itself; OpenAI clients take the API root (``.../v1``). Both, with or without a trailing
    slash, name the same server, so both become ``http://127.0.0.1:8000/v1``. A URL that is not
    http(s) is left as given, for check_target to reject in the user's own words.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        return url
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit(parts._replace(path=path))


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first of GET /models
    endpoint: str = "completions"  # "completions" | "chat" | "responses"
    stream: bool = True
    num_prompts: int = 100
    duration_s: float = 600.0  # hard bound: requests still running then are cancelled
    request_rate: float = math.inf  # requests/s; inf sends all at once (up to max_concurrency)
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 is Poisson
    max_concurrency: int | None = None
    seed: int = 0
    input_len: int = 256
    output_len: int = 128
    input_len_range: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    output_len_range: float = 0.0
    prefix_len: int = 0  # tokens of one shared prefix ahead of synthetic prompts
    prefix_fraction: float = 1.0  # of the synthetic prompts, the share that start with it
    turns: int = 1  # synthetic chat sessions of this many turns, each resending its history
    session_history: int = 0  # tokens of each session's own text ahead of its first turn
    dataset: str | None = None  # JSONL with "prompt" or "messages", optional "max_tokens"
    ignore_eos: bool = True
    temperature: float = 0.0
    # Merged into every request body (per-request policy overrides, sampling knobs); left out
    # of the hash so configs stay usable as dict keys in a sweep.
    extra_body: dict[str, Any] = field(default_factory=dict, hash=False)
    slo: SLO = SLO()
    scrape_interval_s: float = 0.5  # 0 turns /metrics scraping off
    request_timeout_s: float = 300.0
    calibrate: bool = True  # size synthetic prompts with the server's /tokenize when it has one
    api_key: str | None = None
    allow_remote: bool = False
    show_progress: bool = False

    def __post_init__(self) -> None:
        # Normalized here, the one door every caller (CLI, tune, tests) passes through.
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not self.duration_s > 0 or not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("duration, request rate and burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        for r in (self.input_len_range, self.output_len_range):
            if not 0 <= r < 1:
                raise ValueError("length ranges are ratios in [0, 1)")
        if not 0 <= self.prefix_fraction <= 1 or self.turns < 1:
            raise ValueError("prefix_fraction is in [0, 1] and turns at least 1")
        if self.session_history < 0:
            raise ValueError("session_history must not be negative")
        if self.prefix_len < 0 or self.scrape_interval_s < 0 or not self.request_timeout_s > 0:
            raise ValueError("prefix_len, scrape interval and request timeout must not be negative")

    @property
    def endpoint_url(self) -> str:
        """Where the load goes: the base URL and the endpoint's path."""
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def templated(self) -> bool:
        """Whether prompts go as messages, through the server's chat template."""
        return self.endpoint in TEMPLATED_ENDPOINTS

    @property
    def root_url(self) -> str:
        """The server root, where /metrics and /tokenize live (base URL without ``/v1``)."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class BenchRequest:
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_tokens_est: int | None = None  # used when the server reports no usage
    after: int | None = None  # sent once this earlier request (a session's last turn) ended


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the benchmark start."""

    index: int
    scheduled_s: float
    start_s: float | None = None  # later than scheduled_s when waiting for a concurrency slot
    end_s: float | None = None
    success: bool = False
    cancelled: bool = False  # still running when the duration bound was reached
    status: int | None = None
    failure: str | None = None  # HTTP status as text, or "timeout" / "connection" / "stream"
    error: str | None = None
    retry_after: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served
    output_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def e2e_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        e2e = self.e2e_s
        if not self.success or e2e is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (e2e - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, failure: str, error: str, status: int | None = None) -> None:
        self.success, self.failure, self.error, self.status = False, failure, error[:500], status

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "e2e_s": self.e2e_s, "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class LatencyStats:
    count: int
    mean_ms: float | None
    median_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


def latency_stats(samples_s: Sequence[float]) -> LatencyStats:
    """Mean and percentiles (linear interpolation, as numpy's default) in milliseconds."""
    if len(samples_s) == 0:
        return LatencyStats(0, None, None, None, None)
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return LatencyStats(len(ms), float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    not_sent: int
    failed_by_status: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    cached_input_tokens: int | None  # served by the prefix cache; None: never reported
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_in_flight: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    queue_delay: LatencyStats  # client-side wait for a --max-concurrency slot
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    good_requests: int | None
    by_turn: tuple[TurnStats, ...] = ()  # with --turns > 1: each turn's requests alone


@dataclass(frozen=True)
class TurnStats:
    """The requests of one turn of every chat session (turn 1: every session's first)."""

    turn: int
    completed: int
    ttft: LatencyStats
    cached_fraction: float | None  # of the turn's prompt tokens, served by the prefix cache


def turn_stats(records: Sequence[RequestRecord], planned: int, turns: int) -> list[TurnStats]:
    """``synthetic_requests`` numbers every session's first turn, then every second one...:
    request i is turn i // sessions."""
    sessions = math.ceil(planned / turns)
    out = []
    for t in range(turns):
        ok = [r for r in records if r.success and r.index // sessions == t]
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        fraction = sum(cached) / prompt if cached and prompt else None
        ttft = latency_stats([r.ttft_s for r in ok if r.ttft_s is not None])
        out.append(TurnStats(t + 1, len(ok), ttft, fraction))
    return out


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO, planned: int, turns: int = 1
) -> Summary:
    """Aggregate per-request records; throughputs count successful requests only."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success and not r.cancelled]
    by_status: dict[str, int] = {}
    for r in failed:
        key = r.failure or "unknown"
        by_status[key] = by_status.get(key, 0) + 1
    n_in = sum(r.prompt_tokens or 0 for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    good = sum(slo.met_by(r) for r in ok) if slo.defined else None
    started = [r for r in records if r.start_s is not None]
    return Summary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(failed),
        cancelled=sum(r.cancelled for r in records),
        not_sent=planned - len(records),
        failed_by_status=dict(sorted(by_status.items())),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        cached_input_tokens=(
            sum(r.cached_tokens or 0 for r in ok)
            if any(r.cached_tokens is not None for r in ok)
            else None
        ),
        request_throughput=len(ok) / dur,
        input_throughput=n_in / dur,
        output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur,
        max_in_flight=max_in_flight(records),
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        itl=latency_stats([x for r in ok for x in r.itl_s]),
        e2e=latency_stats([t for r in ok if (t := r.e2e_s) is not None]),
        queue_delay=latency_stats([r.start_s - r.scheduled_s for r in started]),
        goodput=None if good is None else good / dur,
        good_requests=good,
        by_turn=tuple(turn_stats(records, planned, turns)) if turns > 1 else (),
    )


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    # Ends sort before starts at the same instant so back-to-back requests do not overlap.
    events = sorted(
        [(r.start_s, 1) for r in records if r.start_s is not None and r.end_s is not None]
        + [(r.end_s, -1) for r in records if r.start_s is not None and r.end_s is not None]
    )
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@dataclass
class MetricsSeries:
    """Scraped /metrics samples: ``values[name][i]`` was read at ``t_s[i]`` (None: absent).

    Names are the metric suffixes (``num_requests_running``...), summed over label sets (the
    KV usage takes the maximum: the fullest group is the one that runs out); with more than
    one label set each also gets its own series, named ``suffix{label="value"}``.
    """

    t_s: list[float] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)
    counters_first: dict[str, float] = field(default_factory=dict)
    counters_last: dict[str, float] = field(default_factory=dict)

    def add(self, t: float, gauges: dict[str, float], counters: dict[str, float]) -> None:
        for name in gauges.keys() - self.values.keys():
            self.values[name] = [None] * len(self.t_s)
        for name, series in self.values.items():
            series.append(gauges.get(name))
        self.t_s.append(t)
        if not self.counters_first:
            self.counters_first = dict(counters)
        self.counters_last = dict(counters)

    @property
    def counter_deltas(self) -> dict[str, float]:
        """How much each counter (preemptions, policy decisions...) grew during the run."""
        return {k: v - self.counters_first.get(k, 0.0) for k, v in self.counters_last.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"t_s": self.t_s, "values": self.values, "counter_deltas": self.counter_deltas}


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """Prometheus text -> (gauges we chart, every kvserve/vLLM ``*_total`` counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    # A gauge by prefix, then suffix: kvserve exports vLLM's names too, and its own win.
    per_label: dict[str, dict[str, dict[str, float]]] = {p: {} for p in METRIC_PREFIXES}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in METRIC_PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            if s.name.endswith("_total"):
                counters[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
                continue
            suffix = s.name[len(prefix) :]
            suffix = GAUGE_ALIASES.get(suffix, suffix)
            if suffix in SCRAPED_GAUGES:
                per_label[prefix].setdefault(suffix, {})[labels] = float(s.value)
    per_label = {**per_label["vllm:"], **per_label["kvserve:"]}
    gauges: dict[str, float] = {}
    for suffix, by_label in per_label.items():
        combine = max if suffix == "kv_cache_usage_perc" else sum
        gauges[suffix] = float(combine(by_label.values()))
        if len(by_label) > 1:
            gauges.update({f"{suffix}{{{lab}}}": v for lab, v in by_label.items()})
    return gauges, counters


def spec_acceptance(counters: Mapping[str, float]) -> float | None:
    """Speculative decoding's accepted drafts, % of those verified (None: nothing drafted)."""
    drafted = counter_sum(counters, "spec_decode_num_draft_tokens_total")
    accepted = counter_sum(counters, "spec_decode_num_accepted_tokens_total")
    return 100 * accepted / drafted if drafted else None


def counter_sum(counters: Mapping[str, float], suffix: str) -> float:
    """Sum of ``prefix:suffix{any labels}`` (``kvserve:`` or ``vllm:``)."""
    return sum(v for k, v in counters.items() if k.partition("{")[0].endswith(":" + suffix))


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    started_at: str  # wall-clock ISO time of the first request
    summary: Summary
    requests: list[RequestRecord]
    metrics: MetricsSeries

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data (non-finite floats become None)."""
        return _json_safe(
            {
                "config": {
                    **dataclasses.asdict(self.config),
                    "api_key": "***" if self.config.api_key else None,
                },
                "model": self.model,
                "started_at": self.started_at,
                "summary": dataclasses.asdict(self.summary),
                "requests": [r.to_dict() for r in self.requests],
                "metrics": self.metrics.to_dict(),
            }
        )


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# --- target checks --------------------------------------------------------------------------


def is_loopback_url(url: str) -> bool:
    """True when the URL's literal host is loopback; names other than localhost are not resolved."""
    host = urlsplit(url).hostname
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_target(config: BenchConfig) -> None:
    scheme = urlsplit(config.base_url).scheme
    if scheme not in ("http", "https"):
        raise BenchError(f"base URL must be http(s)://..., got {config.base_url!r}")
    if not config.allow_remote and not is_loopback_url(config.base_url):
        raise BenchError(
            f"refusing to load-test {config.base_url}: its host is not loopback "
            "(localhost, 127.0.0.0/8, ::1). Pass --allow-remote if you own that server."
        )


# --- workload -------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds, first at 0: gamma inter-arrivals of mean 1/rate, shape B.

    B = 1 is a Poisson process; B < 1 is burstier, B > 1 more even (as vLLM's benchmark).
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _lengths(n: int, mean: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    lo = max(1, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)) if ratio > 0 else mean)
    return rng.integers(lo, hi + 1, size=n)


def _words(n_tokens: int, tokens_per_word: float, rng: np.random.Generator) -> str:
    n_words = max(1, round(max(n_tokens, 1) / tokens_per_word))
    return " ".join(rng.choice(WORDS, size=n_words))


@dataclass(frozen=True)
class PromptCalibration:
    tokens_per_word: float = 1.0
    overhead_tokens: int = 0  # what the chat template adds around one user message


def synthetic_requests(
    config: BenchConfig, calibration: PromptCalibration = PromptCalibration()
) -> list[BenchRequest]:
    """Random-word prompts, each different from its first word so prefix caching cannot help
    beyond what the workload shares: the ``prefix_len`` tokens ahead of a ``prefix_fraction``
    of the prompts, and with ``turns`` > 1 each session's history (every turn resends the
    conversation so far, with a random-word reply of the turn's output length standing in for
    the model's, and is sent when the session's previous turn has ended), which starts with
    ``session_history`` tokens of its own (LMCache's multi-round QA ``--user-history-prompt``)."""
    rng = np.random.default_rng([config.seed, 0])
    tokens_per_word = calibration.tokens_per_word
    prefix = _words(config.prefix_len, tokens_per_word, rng) + " " if config.prefix_len else ""
    n = config.num_prompts
    in_lens = _lengths(n, config.input_len, config.input_len_range, rng)
    out_lens = _lengths(n, config.output_len, config.output_len_range, rng)
    shared = rng.random(n) < config.prefix_fraction
    sessions = math.ceil(n / config.turns)
    history: list[list[dict[str, Any]]] = [[] for _ in range(sessions)]
    est = [0] * sessions
    out = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=True)):
        session, turn = i % sessions, i // sessions  # all first turns, then all second ones
        text = _words(int(n_in) - calibration.overhead_tokens, tokens_per_word, rng)
        if turn == 0 and config.session_history:  # the session's own document, LMCache's
            history_text = _words(config.session_history, tokens_per_word, rng)
            text, est[session] = history_text + " " + text, config.session_history
        if turn == 0 and shared[i]:
            text, est[session] = prefix + text, est[session] + config.prefix_len
        messages = history[session] + [{"role": "user", "content": text}]
        est[session] += int(n_in)
        after = i - sessions if turn else None
        if config.templated:
            content: dict[str, Any] = {"messages": messages}
        else:
            content = {"prompt": "\n".join(m["content"] for m in messages)}
        out.append(BenchRequest(int(n_out), prompt_tokens_est=est[session], after=after, **content))
        reply = _words(int(n_out), tokens_per_word, rng)
        history[session] = messages + [{"role": "assistant", "content": reply}]
        est[session] += int(n_out)
    return out


def load_dataset(config: BenchConfig) -> list[BenchRequest]:
    """The first ``num_prompts`` lines of a JSONL file, cycled when it has fewer."""
    assert config.dataset is not None
    try:
        lines = Path(config.dataset).read_text().splitlines()
    except OSError as e:
        raise BenchError(f"cannot read dataset {config.dataset}: {e}") from e
    items = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append(_dataset_request(row, config))
        except (ValueError, TypeError, KeyError) as e:
            raise BenchError(f"{config.dataset}:{lineno}: {e}") from e
    if not items:
        raise BenchError(f"dataset {config.dataset} has no requests")
    return [items[i % len(items)] for i in range(config.num_prompts)]


def _dataset_request(row: dict[str, Any], config: BenchConfig) -> BenchRequest:
    max_tokens = int(row.get("max_tokens", config.output_len))
    if "messages" in row:
        messages = list(row["messages"])
        if config.templated:
            return BenchRequest(max_tokens, messages=messages)
        return BenchRequest(max_tokens, prompt="\n".join(str(m["content"]) for m in messages))
    if "prompt" not in row:
        raise KeyError('each line needs "prompt" or "messages"')
    prompt = str(row["prompt"])
    if config.templated:
        return BenchRequest(max_tokens, messages=[{"role": "user", "content": prompt}])
    return BenchRequest(max_tokens, prompt=prompt)


def request_body(config: BenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    if config.endpoint == "responses":
        return responses_body(config, model, req)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": config.temperature,
        "stream": config.stream,
    }
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def responses_body(config: BenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    """OpenAI's Responses API: the conversation as input items, nothing stored (each request
    resends its history, as on the chat endpoint)."""
    body: dict[str, Any] = {
        "model": model,
        "input": req.messages if req.messages is not None else req.prompt,
        "max_output_tokens": req.max_tokens,
        "temperature": config.temperature,
        "stream": config.stream,
        "store": False,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True  # kvserve's and vLLM's extension, as on the other endpoints
    body.update(config.extra_body)
    return body


# --- HTTP -----------------------------------------------------------------------------------


def _make_client(config: BenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    return httpx.AsyncClient(
        headers=headers,
        timeout=timeout,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        # A proxy from the environment must not sit between us and a local server.
        trust_env=not is_loopback_url(config.base_url),
    )


async def default_model(client: httpx.AsyncClient, base_url: str) -> str:
    url = base_url.rstrip("/") + "/models"
    try:
        resp = await client.get(url, timeout=10.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot list models at {url} ({e}); pass --model") from e


async def calibrate_prompts(
    client: httpx.AsyncClient, root_url: str, model: str, chat: bool
) -> PromptCalibration | None:
    """Measure prompt sizing with the server's /tokenize (vLLM's or llama.cpp's shape).

    None when the server has no usable /tokenize; prompts then assume one token per word.
    """
    n_words = 256
    text = " ".join(np.random.default_rng(0).choice(WORDS, size=n_words))
    plain = await _count_tokens(client, root_url, {"model": model, "prompt": text})
    if plain is None:
        plain = await _count_tokens(client, root_url, {"content": text})
    if plain is None or not 0.2 < plain / n_words < 5.0:
        return None
    overhead = 0
    if chat:
        messages = [{"role": "user", "content": text}]
        templated = await _count_tokens(client, root_url, {"model": model, "messages": messages})
        overhead = max(0, templated - plain) if templated is not None else 0
    return PromptCalibration(plain / n_words, overhead)


async def _count_tokens(client: httpx.AsyncClient, root_url: str, body: dict) -> int | None:
    try:
        resp = await client.post(root_url + "/tokenize", json=body, timeout=5.0)
        if resp.status_code != 200:
            return None
        data = resp.json()
        count = data.get("count")
        return int(count) if count is not None else len(data["tokens"])
    except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _chunk_text(payload: dict[str, Any]) -> str:
    kind = payload.get("type")
    if isinstance(kind, str) and kind.startswith("response."):
        # A Responses event: text, a function call's arguments and reasoning come as deltas.
        return str(payload.get("delta") or "") if kind.endswith(".delta") else ""
    if isinstance(payload.get("output"), list):  # a whole Responses answer
        return "".join(
            str(part.get("text") or "")
            for item in payload["output"]
            for part in item.get("content") or []
        )
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    part = choice.get("delta") or choice.get("message") or {}
    # Reasoning models stream their thinking apart from the answer; both are output tokens.
    return "".join(part.get(k) or "" for k in ("content", "reasoning_content", "reasoning"))


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(payload)


def _take_usage(rec: RequestRecord, payload: dict[str, Any]) -> None:
    # The Responses API puts it on the response (in its final event) and names it its own way.
    usage = payload.get("usage") or (payload.get("response") or {}).get("usage")
    if not usage:
        return
    rec.usage_reported = True
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if prompt is not None:
        rec.prompt_tokens = int(prompt)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if completion is not None:
        rec.output_tokens = int(completion)


async def _read_sse(resp: httpx.Response, rec: RequestRecord, start: float) -> None:
    last = start
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        payload = json.loads(data)
        if "error" in payload or payload.get("type") in ("error", "response.failed"):
            rec.fail("stream", _error_message(payload), resp.status_code)
            return
        if _chunk_text(payload):
            if chunks == 0:
                rec.ttft_s = now - start
            else:
                rec.itl_s.append(now - last)
            last = now
            chunks += 1
        _take_usage(rec, payload)
    if not rec.usage_reported:
        rec.output_tokens = chunks
    rec.success = True


async def _read_json(resp: httpx.Response, rec: RequestRecord) -> None:
    payload = resp.json()
    _take_usage(rec, payload)
    if not rec.usage_reported:
        rec.output_tokens = 1 if _chunk_text(payload) else 0
    rec.success = True


async def _fail_http(resp: httpx.Response, rec: RequestRecord) -> None:
    await resp.aread()
    try:
        message = _error_message(resp.json())
    except ValueError:
        message = resp.text
    rec.retry_after = resp.headers.get("retry-after")
    rec.fail(str(resp.status_code), message or resp.reason_phrase, resp.status_code)


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t0: float,
) -> None:
    """Run one request into ``rec``; failures are recorded, never raised."""
    start = time.perf_counter()
    rec.start_s = start - t0
    try:
        if body.get("stream"):
            async with client.stream("POST", url, json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    await _fail_http(resp, rec)
                else:
                    await _read_sse(resp, rec, start)
        else:
            resp = await client.post(url, json=body)
            rec.status = resp.status_code
            if resp.status_code != 200:
                await _fail_http(resp, rec)
            else:
                await _read_json(resp, rec)
    except asyncio.CancelledError:
        rec.cancelled = True
        raise
    except httpx.TimeoutException as e:
        rec.fail("timeout", f"{type(e).__name__}: {e}", rec.status)
    except httpx.HTTPError as e:
        rec.fail("connection", f"{type(e).__name__}: {e}", rec.status)
    except Exception as e:  # a malformed reply from the server under test is a result, too
        rec.fail("stream", f"{type(e).__name__}: {e}", rec.status)
    finally:
        rec.end_s = time.perf_counter() - t0


class MetricsScraper:
    """Samples the server's Prometheus /metrics into a MetricsSeries; silent when absent."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float) -> None:
        self.client, self.url, self.interval_s = client, url, interval_s
        self.series = MetricsSeries()
        self.available = False

    async def scrape(self, t: float) -> bool:
        try:
            resp = await self.client.get(self.url, timeout=max(self.interval_s, 2.0))
            if resp.status_code != 200:
                return False
            gauges, counters = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError):
            return False
        self.series.add(t, gauges, counters)
        return True

    async def probe(self) -> bool:
        """One reading before the load starts (the counter baseline)."""
        if self.interval_s > 0:
            self.available = await self.scrape(0.0)
        return self.available

    async def run(self, t0: float) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape(time.perf_counter() - t0)


# --- the run --------------------------------------------------------------------------------


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the load described by ``config`` and return everything measured.

    Raises BenchError when the benchmark cannot start (non-loopback target without
    ``allow_remote``, no model listed, bad dataset); request failures are data in the result.
    """
    check_target(config)
    async with _make_client(config) as client:
        model = config.model or await default_model(client, config.base_url)
        if config.dataset is not None:
            requests = load_dataset(config)
        else:
            calibration = None
            if config.calibrate:
                calibration = await calibrate_prompts(
                    client, config.root_url, model, config.templated
                )
            requests = synthetic_requests(config, calibration or PromptCalibration())
        scraper = MetricsScraper(client, config.root_url + "/metrics", config.scrape_interval_s)
        await scraper.probe()
        started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        records, duration_s = await _drive(client, config, model, requests, scraper)
    turns = config.turns if config.dataset is None else 1
    summary = summarize(records, duration_s, config.slo, len(requests), turns)
    return BenchResult(config, model, started_at, summary, records, scraper.series)


async def _drive(
    client: httpx.AsyncClient,
    config: BenchConfig,
    model: str,
    requests: list[BenchRequest],
    scraper: MetricsScraper,
) -> tuple[list[RequestRecord], float]:
    url = config.endpoint_url
    times = arrival_times(
        len(requests), config.request_rate, config.burstiness, _arrival_rng(config)
    )
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    bar = tqdm(total=len(requests), disable=not config.show_progress, unit="req", leave=False)

    ended = [asyncio.Event() for _ in requests]

    async def one(rec: RequestRecord, body: dict[str, Any], after: int | None) -> None:
        try:
            if after is not None:
                await ended[after].wait()
                rec.scheduled_s = max(rec.scheduled_s, time.perf_counter() - t0)
            if slots is None:
                await send_request(client, url, body, rec, t0)
            else:
                async with slots:
                    await send_request(client, url, body, rec, t0)
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        finally:
            ended[rec.index].set()
        bar.update(1)

    async def dispatch() -> None:
        for i, (req, at) in enumerate(zip(requests, times, strict=True)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(index=i, scheduled_s=float(at))
            records.append(rec)
            body = request_body(config, model, req)
            tasks.append(asyncio.create_task(one(rec, body, req.after)))
        await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    scraping = asyncio.create_task(scraper.run(t0)) if scraper.available else None
    dispatcher = asyncio.create_task(dispatch())
    try:
        done, _ = await asyncio.wait({dispatcher}, timeout=config.duration_s)
        if not done:
            dispatcher.cancel()
            for task in tasks:
                task.cancel()
        await asyncio.gather(dispatcher, *tasks, return_exceptions=True)
        duration_s = time.perf_counter() - t0
    finally:
        bar.close()
        if scraping is not None:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
    if scraper.available:
        await scraper.scrape(time.perf_counter() - t0)
    return records, duration_s


def _arrival_rng(config: BenchConfig) -> np.random.Generator:
    # Apart from the prompt stream, so a change of prompt lengths does not move the arrivals.
    return np.random.default_rng([config.seed, 1])


# --- report ---------------------------------------------------------------------------------


def format_summary(result: BenchResult) -> str:
    s = result.summary
    w = 50
    lines = ["{:=^{w}}".format(" Serving Benchmark Result ", w=w)]

    def row(label: str, value: Any, fmt: str = "") -> None:
        text = "n/a" if value is None else format(value, fmt)
        lines.append(f"{label:<{w - 12}}{text:>12}")

    lines.append(f"Model: {result.model}")
    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    for status, count in s.failed_by_status.items():
        row(f"  failed with {status}:", count)
    if s.cancelled or s.not_sent:
        row("Cancelled at the time bound:", s.cancelled)
        row("Not sent:", s.not_sent)
    row("Benchmark duration (s):", s.duration_s, ".2f")
    row("Total input tokens:", s.total_input_tokens)
    row("Total generated tokens:", s.total_output_tokens)
    if s.cached_input_tokens is not None:
        rate = 100 * s.cached_input_tokens / max(s.total_input_tokens, 1)
        row("Prefix cache hit rate (% of input):", rate, ".2f")
    row("Request throughput (req/s):", s.request_throughput, ".2f")
    if s.goodput is not None:
        row("Request goodput (req/s):", s.goodput, ".2f")
    row("Input token throughput (tok/s):", s.input_throughput, ".2f")
    row("Output token throughput (tok/s):", s.output_throughput, ".2f")
    row("Total token throughput (tok/s):", s.total_token_throughput, ".2f")
    row("Peak requests in flight:", s.max_in_flight)
    for title, abbrev, stats in (
        ("Time to First Token", "TTFT", s.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot),
        ("Inter-token Latency", "ITL", s.itl),
        ("End-to-end Latency", "E2E", s.e2e),
    ):
        lines.append("{:-^{w}}".format(f" {title} ", w=w))
        row(f"Mean {abbrev} (ms):", stats.mean_ms, ".2f")
        row(f"Median {abbrev} (ms):", stats.median_ms, ".2f")
        row(f"P90 {abbrev} (ms):", stats.p90_ms, ".2f")
        row(f"P99 {abbrev} (ms):", stats.p99_ms, ".2f")
    if s.by_turn:
        lines.append("{:-^{w}}".format(" By turn of the sessions ", w=w))
        for t in s.by_turn:
            row(f"Turn {t.turn} median TTFT (ms):", t.ttft.median_ms, ".2f")
            cached = None if t.cached_fraction is None else 100 * t.cached_fraction
            row(f"Turn {t.turn} prefix cache hits (%):", cached, ".1f")
    m = result.metrics
    if m.t_s:
        lines.append("{:-^{w}}".format(" Server /metrics ", w=w))
        accepted = spec_acceptance(m.counter_deltas)
        if accepted is not None:
            row("Speculative drafts accepted (%):", accepted, ".1f")
        for name in SCRAPED_GAUGES:
            vals = [v for v in m.values.get(name, []) if v is not None]
            row(f"Peak {name}:", max(vals) if vals else None, ".4g")
        for name, delta in sorted(m.counter_deltas.items()):
            if delta:
                label = f"{name}:"
                if len(label) > w - 12:  # labelled series: name on its own line, never cut
                    lines.append(label)
                    label = ""
                row(label, delta, ".6g")
    lines.append("=" * w)
    return "\n".join(lines)


def write_result_json(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
    return path
