"""Prometheus metrics for GET /metrics (text exposition format).

Counters and histograms are updated as requests run; gauges (requests running/waiting, KV-cache pages)
are read from the generator and cache at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created samples: they only clutter the output

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)


class _LiveGauges:
    """Reads the model manager's state each time /metrics is scraped."""

    def __init__(self, manager):
        self.manager = manager

    def collect(self):
        s = self.manager.stats()
        for name, help_, key in (
            ("exl_num_requests_running", "requests being decoded now", "running"),
            ("exl_num_requests_waiting", "requests queued for a batch slot or cache pages (preempted ones too)",
             "waiting"),
            ("exl_num_requests_preempted", "waiting requests that ran and were preempted when the cache was full "
             "(they keep their tokens and go on when pages are free)", "preempted"),
            ("exl_cache_pages_in_use", "KV-cache pages held by requests", "pages_in_use"),
            ("exl_cache_pages_total", "KV-cache pages in all", "pages_total"),
            ("exl_cache_usage_ratio", "fraction of KV-cache pages in use (0 to 1)", "cache_usage"),
            ("exl_model_loaded", "1 while a model is loaded", "loaded"),
        ):
            g = GaugeMetricFamily(name, help_)
            g.add_metric([], float(s.get(key, 0) or 0))
            yield g
        c = CounterMetricFamily("exl_preemptions", "times a running request was preempted to free cache pages")
        c.add_metric([], float(s.get("preemptions", 0) or 0))
        yield c


class Metrics:
    """All server metrics, in a registry of their own (several apps can live in one process)."""

    def __init__(self, manager):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exl_requests", "finished generation requests (choices)", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("exl_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("exl_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("exl_cached_prompt_tokens", "prompt tokens reused from the cache", registry=r)
        self.ttft = Histogram("exl_time_to_first_token_seconds", "time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("exl_inter_token_latency_seconds", "time between consecutive generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("exl_e2e_request_latency_seconds", "time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.http_errors = Counter("exl_http_errors", "requests answered with an error", ["status"], registry=r)
        r.register(_LiveGauges(manager))

    def render(self) -> bytes:
        return generate_latest(self.registry)
