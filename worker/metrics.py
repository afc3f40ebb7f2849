"""Prometheus metrics of one worker, in a registry of its own (not the global one), so
two apps in one process (tests, benchmarks) never share or clash on counters.

Engine state (queue, KV usage, cumulative tokens) is read from `engine.stats()` at
scrape time by a collector, so it is never stale and never counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.http import LATENCY_BUCKETS
from worker.engine.types import EngineStats


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], draining: Callable[[], bool]) -> None:
        self._stats = stats
        self._draining = draining

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "radix_worker_running_requests": ("Requests admitted to the engine", s.running),
            "radix_worker_waiting_requests": ("Requests queued in the engine", s.waiting),
            "radix_worker_kv_capacity_tokens": ("KV cache capacity", s.cache_capacity_tokens),
            "radix_worker_kv_used_tokens": ("KV slots in use or cached", s.cache_used_tokens),
            "radix_worker_draining": ("1 while shutting down", int(self._draining())),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "radix_worker_prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens_total),
            "radix_worker_cached_tokens": (
                "Prompt tokens served from the KV cache",
                s.cached_tokens_total,
            ),
            "radix_worker_completion_tokens": ("Tokens generated", s.completion_tokens_total),
            "radix_worker_preemptions": (
                "Running requests sent back to the queue because KV ran short",
                s.preemptions_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class WorkerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], draining: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "radix_worker_requests", "HTTP requests answered", ["endpoint", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "radix_worker_request_duration_seconds", "Time to the last byte", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "radix_worker_time_to_first_token_seconds", "Time to the first generated token",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(stats, draining))

    def render(self) -> bytes:
        return generate_latest(self.registry)
