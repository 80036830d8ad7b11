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
        self.last_stats: StatsMsg | None = None

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
