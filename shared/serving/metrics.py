"""The Prometheus pieces both services build alike, defined once.

Each app gets a registry of its own (never the global one), so two apps in one process
(tests, benchmarks, `radix-router up`) never share or clash on counters. It carries
`process_*` (CPU, memory, open fds) and `python_info`, as the default registry does, and
the two request metrics every service exports: `<prefix>_requests{endpoint,status}` and
`<prefix>_request_duration_seconds{endpoint}`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from shared.serving.gc_policy import FrozenCollector
from shared.serving.loop_metrics import LoopCounter, LoopHistogram

# Request latency histogram buckets (seconds); Prometheus adds +Inf. Up to 2 minutes:
# a long generation is still a normal request.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def kv_usage_ratio(used_tokens: int, capacity_tokens: int) -> float:
    """KV cache in use / capacity, clamped to 0..1; 0 while no capacity is known. What
    Kubernetes-native inference gateways read (vLLM's `kv_cache_usage_perc`)."""
    if capacity_tokens <= 0:
        return 0.0
    return min(used_tokens, capacity_tokens) / capacity_tokens


class ServiceMetrics:
    """A service's registry and request metrics; subclasses add their own to `registry`."""

    def __init__(self, prefix: str) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        # How often the collector ran, and what start-up froze (shared/serving/gc_policy.py).
        GCCollector(registry=r)
        r.register(FrozenCollector())
        # Updated per request on the loop: no lock per update (shared/serving/loop_metrics.py).
        self.requests = LoopCounter(
            f"{prefix}_requests", "Requests answered", ["endpoint", "status"], registry=r
        )
        self.latency = LoopHistogram(
            f"{prefix}_request_duration_seconds", "Time to the last byte of the response",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        # `labels()` costs a lock and a tuple build per call; the hot path reuses children.
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: Counter | Histogram | LoopCounter | LoopHistogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: label values must come from a bounded set."""
        key = (metric._name, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        self.child(self.requests, endpoint, str(status)).inc()
        self.child(self.latency, endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
