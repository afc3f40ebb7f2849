"""Prometheus metrics of one worker, in a registry of its own (not the global one), so
two apps in one process (tests, benchmarks) never share or clash on counters.

Engine state (queue, KV usage, cumulative tokens) is read from `engine.stats()` at
scrape time by a collector, so it is never stale and never counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.http import LATENCY_BUCKETS
from worker.engine.types import EngineStats, GenerateOutput

# Per output token: decode steps run from about a millisecond (small models, big GPUs)
# to a few hundred (CPU, long batches).
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


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
            # What Kubernetes-native inference gateways read (vLLM: kv_cache_usage_perc).
            "radix_worker_kv_cache_usage_ratio": (
                "KV cache in use / capacity (0..1)",
                min(1.0, s.cache_used_tokens / s.cache_capacity_tokens)
                if s.cache_capacity_tokens > 0
                else 0.0,
            ),
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
        self.queue = Histogram(
            "radix_worker_queue_time_seconds", "Time waiting in the engine before admission",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "radix_worker_time_per_output_token_seconds",
            "Inter-token latency: (last token - first token) / (completion tokens - 1)",
            ["endpoint"], buckets=_TPOT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(stats, draining))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def first_output(self, endpoint: str, ttft: float, queue_seconds: float | None) -> None:
        self.ttft.labels(endpoint).observe(ttft)
        if queue_seconds is not None:
            self.queue.labels(endpoint).observe(queue_seconds)

    def last_output(self, endpoint: str, since_first: float, last: GenerateOutput) -> None:
        if last.completion_tokens > 1:
            self.tpot.labels(endpoint).observe(since_first / (last.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
