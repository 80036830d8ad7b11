"""Prometheus metrics of the API server (served at /metrics)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from minisgl.message import StatsMsg

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# minisgl_kv_tier_chunks{event} <- TierStats field
_TIER_CHUNK_FIELDS = {
    "written": "chunks_written",
    "read": "chunks_read",
    "dropped": "writes_dropped",
    "corrupt": "corrupt_skipped",
    "missing": "missing_skipped",
    "evicted": "files_evicted",
    "write_errors": "write_errors",
}


class ServerMetrics:
    """Counters and histograms from the token stream, gauges from the scheduler's stats.

    Each server owns its registry (not the process-global one), so several apps in one
    process (tests) never collide.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("minisgl_num_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("minisgl_num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge(
            "minisgl_kv_cache_usage_ratio", "Fraction of KV pages not free", registry=r
        )
        self.kv_pages = Gauge(
            "minisgl_kv_pages", "KV pages by state", ["state"], registry=r
        )  # state: total, free, cached
        self.pages_ok = Gauge(
            "minisgl_page_accounting_ok",
            "1 if free + cached pages == all pages at the last idle check",
            registry=r,
        )
        self.hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / all",
            registry=r,
        )
        self.requests = Counter(
            "minisgl_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.aborted = Counter(
            "minisgl_aborted_requests", "Requests aborted because the client went away", registry=r
        )
        self.errors = Counter(
            "minisgl_request_errors", "Requests rejected with an error", ["status"], registry=r
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "minisgl_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Request arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(
            "minisgl_prefix_cache_hit_tokens",
            "Prompt tokens served from a cache tier (memory: the radix tree; disk: loaded back "
            "from the disk KV tier)",
            ["tier"],
            registry=r,
        )
        self.evicted = Counter(
            "minisgl_radix_evicted_tokens",
            "Tokens evicted from the radix tree, by eviction policy",
            ["policy"],
            registry=r,
        )
        self.tier_chunks = Counter(
            "minisgl_kv_tier_chunks",
            "Disk KV tier chunk files: written, read, dropped (write queue full), corrupt "
            "(rejected and recomputed), missing, evicted (disk budget), write_errors",
            ["event"],
            registry=r,
        )
        self.tier_bytes = Counter(
            "minisgl_kv_tier_bytes", "Disk KV tier bytes written and read", ["op"], registry=r
        )
        self.tier_disk = Gauge(
            "minisgl_kv_tier_disk", "Disk KV tier now: files and bytes", ["unit"], registry=r
        )
        self.spec_tokens = Counter(
            "minisgl_spec_tokens",
            "Speculative decoding: draft tokens verified (drafted) and kept (accepted)",
            ["kind"],
            registry=r,
        )
        self.spec_verify_steps = Counter(
            "minisgl_spec_verify_steps", "Speculative decoding: request verify steps", registry=r
        )
        self.spec_accept_length = Gauge(
            "minisgl_spec_accept_length",
            "Speculative decoding: mean tokens a request gets per verify step (accepted drafts "
            "plus the one sampled)",
            registry=r,
        )
        self.last_stats: StatsMsg | None = None
        # Lifetime totals as last reported: counters move by the difference.
        self._totals: dict[str, int] = {}

    def update_stats(self, stats: StatsMsg) -> None:
        self.last_stats = stats
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(1.0 - stats.free_pages / stats.num_pages if stats.num_pages else 0.0)
        self.kv_pages.labels("total").set(stats.num_pages)
        self.kv_pages.labels("free").set(stats.free_pages)
        self.kv_pages.labels("cached").set(stats.cached_pages)
        self.hit_rate.set(stats.hit_rate)
        if stats.pages_ok is not None:
            self.pages_ok.set(1.0 if stats.pages_ok else 0.0)
        tier = stats.tier or {}
        disk_hits = tier.get("tokens_loaded", 0)
        self._advance(self.cache_hits.labels("memory"), "memory", stats.cached_tokens - disk_hits)
        self._advance(self.cache_hits.labels("disk"), "disk", disk_hits)
        policy = stats.eviction_policy or "lru"
        self._advance(self.evicted.labels(policy), "evicted", stats.evicted_tokens)
        if stats.spec:
            spec = stats.spec
            self._advance(self.spec_tokens.labels("drafted"), "spec_drafted", spec["draft_tokens"])
            accepted = spec["accepted_tokens"]
            self._advance(self.spec_tokens.labels("accepted"), "spec_accepted", accepted)
            steps = spec["verify_steps"]
            self._advance(self.spec_verify_steps, "spec_steps", steps)
            self.spec_accept_length.set(1.0 + accepted / steps if steps else 0.0)
        if not tier:
            return
        for event, field in _TIER_CHUNK_FIELDS.items():
            self._advance(self.tier_chunks.labels(event), field, tier.get(field, 0))
        for op in ("written", "read"):
            self._advance(self.tier_bytes.labels(op), f"bytes_{op}", tier.get(f"bytes_{op}", 0))
        self.tier_disk.labels("files").set(tier.get("files", 0))
        self.tier_disk.labels("bytes").set(tier.get("disk_bytes", 0))

    def _advance(self, counter: Counter, name: str, total: int) -> None:
        """Move `counter` to the scheduler's lifetime `total` (never backwards)."""
        delta = total - self._totals.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._totals[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
