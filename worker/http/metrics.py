"""Prometheus metrics of one worker (its registry and request metrics: `shared/serving/metrics.py`).

Engine state (queue, KV usage, cumulative tokens) is read from `engine.stats()` at
scrape time by a collector, so it is never stale and never counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.serving.metrics import LATENCY_BUCKETS, ServiceMetrics, kv_usage_ratio
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
            "radix_worker_kv_capacity_tokens": ("KV cache capacity", s.kv_capacity_tokens),
            "radix_worker_kv_used_tokens": ("KV slots in use or cached", s.kv_used_tokens),
            "radix_worker_draining": ("1 while shutting down", int(self._draining())),
            "radix_worker_pins": ("Prefixes pinned across tool gaps", s.pins),
            "radix_worker_pinned_tokens": ("KV tokens held by pins", s.pinned_tokens),
            "radix_worker_kv_cache_usage_ratio": (
                "KV cache in use / capacity (0..1)",
                kv_usage_ratio(s.kv_used_tokens, s.kv_capacity_tokens),
            ),
        }
        if s.host_kv_capacity_tokens:
            gauges |= {
                "radix_worker_host_kv_capacity_tokens": (
                    "Host KV tier capacity (tokens)",
                    s.host_kv_capacity_tokens,
                ),
                "radix_worker_host_kv_used_tokens": (
                    "Host KV tier slots holding cached pages",
                    s.host_kv_used_tokens,
                ),
                "radix_worker_host_load_bytes_per_second": (
                    "Host -> device KV load bandwidth, measured (sim: configured); 0 before the first load",
                    s.host_load_bytes_per_s,
                ),
                "radix_worker_kv_bytes_per_token": ("KV bytes of one token", s.kv_bytes_per_token),
            }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        tiers = CounterMetricFamily(
            "radix_worker_cached_tokens_by_tier",
            "Prompt tokens served from the KV cache, by the tier that held them",
            labels=["tier"],
        )
        tiers.add_metric(["device"], s.cached_tokens_total - s.host_cached_tokens_total)
        tiers.add_metric(["host"], s.host_cached_tokens_total)
        yield tiers
        counters = {
            "radix_worker_prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens_total),
            "radix_worker_cached_tokens": (
                "Prompt tokens served from the KV cache",
                s.cached_tokens_total,
            ),
            "radix_worker_completion_tokens": ("Tokens generated", s.completion_tokens_total),
            "radix_worker_host_load_tokens": (
                "Tokens loaded from the host KV tier into the device pool",
                s.host_load_tokens_total,
            ),
            "radix_worker_host_write_tokens": (
                "Tokens written back from the device pool to the host KV tier",
                s.host_write_tokens_total,
            ),
            "radix_worker_preemptions": (
                "Running requests sent back to the queue because KV ran short",
                s.preemptions_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class WorkerMetrics(ServiceMetrics):
    def __init__(self, stats: Callable[[], EngineStats], draining: Callable[[], bool]) -> None:
        super().__init__("radix_worker")
        r = self.registry
        self.ttft = Histogram(
            "radix_worker_time_to_first_token_seconds", "Time to the first generated token",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "radix_worker_queue_time_seconds", "Time waiting in the engine before admission",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "radix_worker_time_per_output_token_seconds",
            "Inter-token latency: (last token - first token) / (completion tokens - 1)",
            ["endpoint"], buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(stats, draining))

    def first_output(self, endpoint: str, ttft: float, queue_seconds: float | None) -> None:
        self.child(self.ttft, endpoint).observe(ttft)
        if queue_seconds is not None:
            self.child(self.queue, endpoint).observe(queue_seconds)

    def last_output(self, endpoint: str, since_first: float, last: GenerateOutput) -> None:
        if last.completion_tokens > 1:
            self.child(self.tpot, endpoint).observe(since_first / (last.completion_tokens - 1))
