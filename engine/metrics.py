"""Prometheus metrics of one engine, in its own registry (vLLM's names under ``kvserve:``).

The engine thread updates them: gauges at every step and whenever requests are added or
aborted, counters and histograms as requests advance. The HTTP side only reads
(``generate_latest(metrics.registry)``); prometheus-client's metric objects are safe to share
between the two threads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from engine.capacity import capacity
from engine.core.config import CacheConfig
from engine.core.context_overflow import CONTEXT_POLICIES, IMPORTANCE_POLICIES
from engine.core.request import Request
from engine.core.scheduler import SchedulerEvents
from engine.core.speculation import SpeculativeConfig

FINISH_REASONS = ("stop", "length", "abort", "error")
PREEMPTION_MODES = ("recompute", "swap")
# Why a request is refused before any work: its context (context_overflow's Reject codes), the
# KV pool, the queue (preemption.Admission), a grammar over the compile-time limit.
REJECT_REASONS = ("context_length_exceeded", "invalid_overflow", "kv_capacity", "queue_full",
                  "queued_tokens", "grammar_too_complex")  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        speculation: SpeculativeConfig | None = None,
    ):
        self.registry = r = registry or CollectorRegistry()
        self.spec_method = speculation.method if speculation else None

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"kvserve:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvserve:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge(
            "num_requests_waiting", "Requests queued: new, or preempted for recomputation."
        )
        self.swapped = gauge(
            "num_requests_swapped", "Preempted requests whose KV cache waits in the host swap pool."
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction of the KV blocks in use (0 to 1), per KV-cache group.",
            ("group",),
        )
        self.kv_bytes_per_token = gauge(
            "kv_cache_bytes_per_token",
            "KV bytes a token holds in a group's layers (scales included), by group and dtype.",
            ("group", "dtype"),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (after truncation).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ("finished_reason",),
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "From arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "From arrival to the first scheduling.", REQUEST_BUCKETS
        )
        self._policy_counters(counter)
        self.prefix_queries = counter(
            "prefix_cache_queries",
            "Tokens looked up in the prefix cache, at each admission (preempted ones again).",
        )
        self.prefix_hits = counter(
            "prefix_cache_hits",
            "Of the tokens looked up, those found in the prefix cache (any tier).",
        )
        self._host_tier_metrics(counter, gauge)
        self.rejected = counter(
            "requests_rejected", "Requests refused before any work, by reason.", ("reason",)
        )
        self._speculation_counters(counter)
        self.cache_config = Info(
            "kvserve:cache_config", "KV-cache layout and capacity.", registry=r
        )
        self._router_metrics(r)
        self._export_known_labels()

    def _host_tier_metrics(self, counter, gauge) -> None:
        self.host_hits = counter(
            "prefix_cache_host_hits",
            "Of the prefix cache's hits, the tokens found in the host tier and copied back up.",
        )
        self.disk_hits = counter(
            "prefix_cache_disk_hits",
            "Of the prefix cache's hits, the tokens found in the disk tier and copied back up.",
        )
        self.tier_blocks = counter(
            "kv_host_tier_blocks",
            "Blocks the host tier wrote down (stored), copied back up (loaded), or could not "
            "take (dropped: every host block held).",
            ("direction",),
        )
        self.disk_blocks = counter(
            "kv_disk_tier_blocks",
            "Blocks the disk tier wrote down (stored), read back up (loaded), or could not "
            "take (dropped); corrupt: files found at start-up that were skipped (a bad "
            "checksum, a cut-off write, another model's).",
            ("direction",),
        )
        self.host_cached = gauge(
            "kv_host_cache_blocks", "Prefix blocks the host tier holds, every group together."
        )
        self.host_capacity = gauge(
            "kv_host_capacity_blocks", "Blocks of the host pools (the swap pool shares them)."
        )
        self.disk_cached = gauge(
            "kv_disk_cache_blocks", "Prefix blocks the disk tier holds, every group together."
        )
        self.disk_capacity = gauge("kv_disk_capacity_blocks", "Blocks the disk tier may hold.")

    def _router_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's names for what a cluster router's endpoint picker scrapes by default (the
        Gateway API inference extension's vllm mapping): one series each, and the cache's
        block size and block count as integers, where kvserve's own metrics are per group."""
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests running.", registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", registry=r)
        self.vllm_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of all KV blocks in use (0 to 1), every group's pool together.",
            registry=r,
        )
        self.vllm_cache_config = Info(
            "vllm:cache_config",
            "block_size and num_gpu_blocks (of the full-attention pool) as integers.",
            registry=r,
        )

    def _policy_counters(self, counter) -> None:
        self.preemptions = counter(
            "num_preemptions",
            "Running requests preempted for lack of KV blocks, by mode (recompute, swap).",
            ("mode",),
        )
        self.context_overflows = counter(
            "context_overflows",
            "Requests at max_model_len (or over it at admission), by the policy that acted.",
            ("policy",),
        )
        self.swapped_blocks = counter(
            "swapped_blocks",
            "KV blocks copied to (out) or back from (in) the host swap pool.",
            ("direction",),
        )
        self.kv_evictions = counter(
            "kv_evictions",
            "Importance evictions (a sequence's cache compacted to its most important tokens), "
            "by policy.",
            ("policy",),
        )
        self.kv_evicted_tokens = counter(
            "kv_evicted_tokens",
            "Cached tokens given up by importance evictions, by policy.",
            ("policy",),
        )

    def _speculation_counters(self, counter) -> None:
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: drafted tokens the target verified, by method.",
            ("method",),
        )
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: drafted tokens the target accepted, by method.",
            ("method",),
        )
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted drafts by position in their run (0: the first).",
            ("method", "position"),
        )

    def _export_known_labels(self) -> None:
        """Every known label value exported from the start, at 0: a dashboard's rate() and an
        alert see a series before its first event."""
        for metric, values in (
            (self.request_success, FINISH_REASONS),
            (self.preemptions, PREEMPTION_MODES),
            (self.context_overflows, CONTEXT_POLICIES),
            (self.swapped_blocks, ("in", "out")),
            (self.tier_blocks, ("stored", "loaded", "dropped")),
            (self.disk_blocks, ("stored", "loaded", "dropped", "corrupt")),
            (self.kv_evictions, IMPORTANCE_POLICIES),
            (self.kv_evicted_tokens, IMPORTANCE_POLICIES),
            (self.rejected, REJECT_REASONS),
        ):
            for value in values:
                metric.labels(value)
        if self.spec_method is not None:
            self.spec_draft_tokens.labels(self.spec_method)
            self.spec_accepted_tokens.labels(self.spec_method)

    def describe_cache(self, cache: CacheConfig, max_model_len: int, **settings) -> None:
        def each(values) -> str:
            return ",".join(str(v) for v in values)

        groups = capacity(cache, max_model_len)
        for gi, g in enumerate(groups):
            self.kv_bytes_per_token.labels(str(gi), g.dtype).set(g.bytes_per_token)
        self.cache_config.info(
            {
                "block_size": str(cache.block_size),
                "num_gpu_blocks": each(g.num_blocks for g in groups),
                "num_cpu_blocks": each(cache.num_host_blocks) or "0",
                "group_kinds": each(g.kind for g in groups),
                "kv_cache_dtype": each(g.dtype for g in groups),
                "bytes_per_token": str(sum(g.bytes_per_token for g in groups)),
                "capacity_tokens": each(g.tokens for g in groups),
                "max_seqs_at_max_model_len": str(min(g.max_seqs_at_full_len for g in groups)),
                "max_model_len": str(max_model_len),
                **{k: str(v) for k, v in settings.items()},
            }
        )
        # A whole context's blocks come from the full-attention pools (a window's ring holds
        # a bounded part): the smallest of those bounds how many tokens the cache keeps.
        full = [g for g in groups if "window" not in g.kind] or groups
        blocks = min(g.num_blocks for g in full)
        self.vllm_cache_config.info(
            {"block_size": str(cache.block_size), "num_gpu_blocks": str(blocks)}
        )

    def gauges(
        self, running: int, waiting: int, swapped: int, usage: list[float], total_usage: float
    ) -> None:
        """``usage`` per group's pool, ``total_usage`` of all their blocks together."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.swapped.set(swapped)
        for gi, u in enumerate(usage):
            self.kv_usage.labels(str(gi)).set(u)
        self.vllm_running.set(running)
        self.vllm_waiting.set(waiting)
        self.vllm_usage.set(total_usage)

    def host_tier(self, cached: int, capacity: int, moved: dict[str, int]) -> None:
        """The host tier's blocks now, and what it moved since the last call."""
        self.host_cached.set(cached)
        self.host_capacity.set(capacity)
        for direction, n in moved.items():
            self.tier_blocks.labels(direction).inc(n)

    def disk_tier(self, cached: int, capacity: int, moved: dict[str, int]) -> None:
        """The disk tier's blocks now, and what it moved since the last call."""
        self.disk_cached.set(cached)
        self.disk_capacity.set(capacity)
        for direction, n in moved.items():
            self.disk_blocks.labels(direction).inc(n)

    def refused(self, reason: str, policy: str | None = None) -> None:
        """A request refused before any work (on the thread that refused it), by ``policy``
        when its context policy did: such a request never reaches the scheduler, which counts
        every other context overflow (``events``)."""
        self.rejected.labels(reason).inc()
        if policy is not None:
            self.context_overflows.labels(policy).inc()

    def events(self, events: SchedulerEvents) -> None:
        """What the scheduler counted since the last step."""
        for mode, n in events.preemptions.items():
            self.preemptions.labels(mode).inc(n)
        for policy, n in events.context_overflows.items():
            self.context_overflows.labels(policy).inc(n)
        for direction, n in events.swapped_blocks.items():
            self.swapped_blocks.labels(direction).inc(n)
        for policy, n in events.evictions.items():
            self.kv_evictions.labels(policy).inc(n)
        for policy, n in events.evicted_tokens.items():
            self.kv_evicted_tokens.labels(policy).inc(n)
        self.prefix_queries.inc(events.prefix_queries)
        self.prefix_hits.inc(events.prefix_hits)
        self.host_hits.inc(events.host_hits)
        self.disk_hits.inc(events.disk_hits)
        if self.spec_method is not None:
            method = self.spec_method
            self.spec_draft_tokens.labels(method).inc(events.drafted)
            self.spec_accepted_tokens.labels(method).inc(sum(events.accepted_at.values()))
            for position, n in events.accepted_at.items():
                self.spec_accepted_per_pos.labels(method, str(position)).inc(n)

    def tokens(self, req: Request, now: float, n: int = 1) -> None:
        """``req`` just received ``n`` tokens at ``now`` (its first ones when it has no
        earlier); a speculative step's tokens arrive together, one inter-token interval."""
        self.generation_tokens.inc(n)
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
            self.prompt_tokens.inc(req.num_tokens - req.num_output_tokens)
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def finished(self, req: Request, now: float) -> None:
        self.request_success.labels(req.finish_reason or "abort").inc()
        self.e2e.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
