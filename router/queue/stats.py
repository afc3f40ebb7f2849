"""What the fleet queue shows: per tenant and class, how many wait, how long they
waited, how many were served, and how many met their class's TTFT objective (goodput
at SLO; attainment = met / served). `/metrics`, `/workers` and the dashboard read it.

A request's TTFT here is the router's: from its arrival to the moment its answer's
head leaves (a stream's head leaves with its first chunk, router/upstream/proxy.py), so
queue time, the worker's queue and its prefill are all in it. A request counts as
served once it ends with a head of status < 400; it met its objective when that head
left within its class's `ttft_slo_s`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily as CounterFamily
from prometheus_client.core import GaugeMetricFamily as GaugeFamily
from prometheus_client.core import HistogramMetricFamily as HistogramFamily
from prometheus_client.registry import Collector

from router.queue.tenants import Tenants
from shared.wire.service_class import CLASSES

# Where a waiting request was placed against its best predicted worker (fleet_queue.py's
# rule): on it (or none predicted better), or away: urgent, held (no one else could use
# the seat), near (its best held at most twice as much).
PLACED = ("best", "urgent", "held", "near")
WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


@dataclass
class ClassTally:
    served: int = 0
    slo_met: int = 0
    refused: int = 0  # 429 past the tenant's own bound
    failed: int = 0  # ended without a good answer (error status, client gone)
    wait_s: float = 0.0  # summed over the requests that got a seat
    # Waits per WAIT_BUCKETS bucket (not cumulative): a list bump per request, where a
    # prometheus Histogram's observe takes a lock (the hot path: every request).
    waits: list[int] = field(default_factory=lambda: [0] * len(WAIT_BUCKETS))

    def seated(self, waited_s: float) -> None:
        self.wait_s += waited_s
        self.waits[bisect_left(WAIT_BUCKETS, waited_s) if waited_s else 0] += 1

    def ended(self, good: bool, slo_met: bool) -> None:
        if good:
            self.served += 1
            self.slo_met += slo_met
        else:
            self.failed += 1

    def as_dict(self) -> dict[str, float]:
        attainment = self.slo_met / self.served if self.served else None
        return {
            "served": self.served, "slo_met": self.slo_met, "refused": self.refused,
            "failed": self.failed, "slo_attainment": attainment,  # type: ignore[dict-item]
            "mean_wait_s": self.wait_s / (self.served + self.failed or 1),
        }  # fmt: skip


class QueueStats:
    def __init__(self, tenants: Tenants, registry: CollectorRegistry | None = None) -> None:
        self.tenants = tenants
        # Where one request's figures go: a ticket keeps its own (one lookup a request).
        self.tallies: dict[tuple[str, str], ClassTally] = {
            (t.name, c): ClassTally() for t in tenants for c in CLASSES
        }
        self.placed = dict.fromkeys(PLACED, 0)
        if registry is not None:
            registry.register(_QueueCollector(self))

    def refused(self, tenant: str, klass: str) -> None:
        self.tallies[tenant, klass].refused += 1

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """{tenant: {class: figures}}, waiting counts included."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for tenant in self.tenants:
            out[tenant.name] = {}
            for rank, klass in enumerate(CLASSES):
                figures = self.tallies[tenant.name, klass].as_dict()
                figures["waiting"] = len(tenant.queues[rank])
                out[tenant.name][klass] = figures
        return out


class _QueueCollector(Collector):
    def __init__(self, stats: QueueStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeFamily | CounterFamily | HistogramFamily]:
        labels = ["tenant", "class"]
        waiting = GaugeFamily(
            "radix_router_queue_waiting", "Requests waiting in the router for a seat", labels=labels
        )
        families = {
            name: CounterFamily(f"radix_router_queue_{name}", text, labels=labels)
            for name, text in (
                ("served", "Requests answered with status < 400"),
                ("slo_met", "Served requests whose first byte left within their class's TTFT SLO"),
                ("refused", "Requests refused with 429 past their tenant's queue bounds"),
                ("failed", "Requests that ended without a good answer"),
            )
        }
        wait = HistogramFamily(
            "radix_router_queue_wait_seconds",
            "Time a request waited in the router for a seat",
            labels=labels,
        )
        bounds = [str(b) if b != float("inf") else "+Inf" for b in WAIT_BUCKETS]
        for tenant in self.stats.tenants:
            for rank, klass in enumerate(CLASSES):
                key = [tenant.name, klass]
                waiting.add_metric(key, len(tenant.queues[rank]))
                tally = self.stats.tallies[tenant.name, klass]
                for name, family in families.items():
                    family.add_metric(key, getattr(tally, name))
                cumulative = list(accumulate(tally.waits))
                wait.add_metric(key, list(zip(bounds, cumulative, strict=True)), tally.wait_s)
        placed = CounterFamily(
            "radix_router_queue_placed",
            "Waiting requests given a seat: on their best predicted worker, or away from it "
            "(urgent, held, near)",
            labels=["placed"],
        )
        for name, n in self.stats.placed.items():
            placed.add_metric([name], n)
        yield waiting
        yield wait
        yield placed
        yield from families.values()
