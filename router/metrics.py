"""Prometheus metrics: one registry per app, so tests and several apps never collide.

Besides traffic counters, this exports how honest the prefix trees' guesses are: for
every response that reports `usage.prompt_tokens_details.cached_tokens`, the ratio of
the worker's actual cached tokens to the tokens the tree predicted
(`matched_chars / tree_chars_per_token`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily as CounterFamily
from prometheus_client.core import GaugeMetricFamily as GaugeFamily
from prometheus_client.registry import Collector

from router.fleet.workers import Worker
from router.upstream.echo import EchoBook
from shared.serving.loop_metrics import CounterChild, HistogramChild, LoopCounter, LoopHistogram
from shared.serving.metrics import ServiceMetrics, kv_usage_ratio
from shared.wire.peers import Rejections

Family = GaugeFamily | CounterFamily

RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, float("inf"))


# Per worker, read from the table at scrape time: (family, name, help, value).
_PER_WORKER: tuple[tuple[type[Family], str, str, Callable[[Worker, float], float]], ...] = (
    (GaugeFamily, "radix_router_worker_in_flight", "Requests in flight", lambda w, _: w.in_flight),
    (GaugeFamily, "radix_router_worker_load", "Load as the policy sees it", lambda w, _: w.load),
    (
        GaugeFamily, "radix_router_worker_breaker_open", "1 when the breaker is open",
        lambda w, now: int(w.breaker.state(now) != "closed"),
    ),
    (
        GaugeFamily, "radix_router_worker_kv_cache_usage_ratio",
        "KV cache in use / capacity, as the worker last reported it (0..1)",
        lambda w, _: kv_usage_ratio(w.report.kv_used_tokens, w.report.kv_capacity_tokens),
    ),
    (
        GaugeFamily, "radix_router_worker_waiting_requests",
        "Requests queued in the worker's engine, as it last reported", lambda w, _: w.report.waiting,
    ),
    (
        CounterFamily, "radix_router_upstream_failures", "Failed attempts to a worker",
        lambda w, _: w.failures_total,
    ),
    (
        CounterFamily, "radix_router_predicted_cached_tokens", "Cached tokens the tree predicted",
        lambda w, _: w.predicted_tokens_total,
    ),
    (
        CounterFamily, "radix_router_actual_cached_tokens", "Cached tokens workers reported",
        lambda w, _: w.actual_cached_tokens_total,
    ),
    (
        GaugeFamily, "radix_router_worker_chars_per_token",
        "Chars of routed text per prompt token, learned from the worker's answers (0: not yet)",
        lambda w, _: w.chars_per_token or 0.0,
    ),
    (
        CounterFamily, "radix_router_worker_calibration_rejected",
        "Answers whose usage.prompt_tokens was implausible and ignored",
        lambda w, _: w.calibration_rejected_total,
    ),
    # Every engine's own prompt and prefix-hit totals, from its heartbeats (attached
    # SGLang / vLLM too): the fleet's real hit rate, where the two above are the tree's.
    (
        CounterFamily, "radix_router_worker_prompt_tokens",
        "Prompt tokens the worker reports having admitted", lambda w, _: w.report.prompt_tokens_total,
    ),
    (
        CounterFamily, "radix_router_worker_cached_tokens",
        "Prompt tokens the worker reports served from its KV cache",
        lambda w, _: w.report.cached_tokens_total,
    ),
)  # fmt: skip


class WorkerTable(Protocol):
    """What metrics read of the fleet at scrape time (`router.fleet.table.Fleet`)."""

    @property
    def workers(self) -> Mapping[str, Worker]: ...


class KvFeedView(Protocol):
    """What the KV-event collector reads (router/holdings/kv_feed.py's KvEventFeed)."""

    indexes: Mapping[str, Any]
    streams: Mapping[str, Any]
    dropped: Mapping[str, int]
    rebuilds: Mapping[str, int]

    def rebuild_of(self, wid: str) -> Any: ...


class PoolCounts(Protocol):
    """What metrics read of the upstream pool (`router.upstream.pool.UpstreamPool`)."""

    @property
    def connects(self) -> int: ...

    @property
    def stale_retries(self) -> int: ...

    @property
    def echo(self) -> EchoBook: ...


class _FleetCollector(Collector):
    """Per-worker numbers read from the fleet table at scrape time: the table keeps the
    books (no second count on the hot path). A worker's counters go with it when it
    leaves the table."""

    def __init__(
        self, fleet: WorkerTable, clock: Callable[[], float], in_flight: Callable[[], int]
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.in_flight = in_flight

    def collect(self) -> Iterator[Family]:
        now = self.clock()
        families = [kind(name, doc, labels=["worker"]) for kind, name, doc, _ in _PER_WORKER]
        values = [value for *_, value in _PER_WORKER]
        routable = 0
        for w in list(self.fleet.workers.values()):
            wid = [w.worker_id]
            for family, value in zip(families, values, strict=True):
                family.add_metric(wid, value(w, now))
            routable += int(not w.report.draining and w.breaker.allows(now))
        yield from families
        yield GaugeFamily(
            "radix_router_workers_routable", "Workers that can take requests", routable
        )
        # What the router HPA scales on: requests this replica holds (admitted + queued).
        yield GaugeFamily(
            "radix_router_in_flight_requests", "Requests held by this router replica",
            self.in_flight(),
        )  # fmt: skip


class ReasonWindow:
    """Routing decisions by reason over the last `window_s` seconds, in `bucket_s`
    buckets, for the dashboard (a Prometheus counter has no window of its own).

    `add` is on every request's path: one dict increment, plus a new bucket every
    `bucket_s` (old ones are dropped then, so memory stays `window_s / bucket_s` small
    dicts). `Metrics.decision` writes that increment itself while `now // bucket_s` is
    `current_at` (the bucket `current` counts), and calls `add` for a new one."""

    def __init__(self, bucket_s: float = 10.0, window_s: float = 300.0) -> None:
        self.bucket_s = bucket_s
        self.buckets = max(1, round(window_s / bucket_s))
        self._counts: dict[int, Tally[str]] = {}
        self.current_at = -1.0  # `now // bucket_s` of the bucket `current` counts
        self.current: Tally[str] = Tally()

    def add(self, reason: str, now: float) -> None:
        at = now // self.bucket_s
        if at != self.current_at:
            self.current_at = at
            index = int(at)
            self.current = self._counts.setdefault(index, Tally())
            oldest = index - self.buckets
            for old in [i for i in self._counts if i <= oldest]:
                del self._counts[old]
        self.current[reason] += 1

    def snapshot(self, now: float) -> dict[str, Any]:
        """Oldest bucket first; `age_s` is how long ago each bucket began."""
        last = int(now // self.bucket_s)
        first = last - self.buckets + 1
        series = [
            {"age_s": round(now - i * self.bucket_s, 1), "counts": dict(self._counts.get(i, {}))}
            for i in range(first, last + 1)
        ]
        totals: Tally[str] = Tally()
        for item in series:
            totals.update(item["counts"])
        return {
            "bucket_s": self.bucket_s,
            "window_s": self.bucket_s * self.buckets,
            "series": series,
            "totals": dict(totals),
        }


class _RejectionsCollector(Collector):
    """Entries the Redis boundary dropped (bad worker records, sync entries), by source."""

    def __init__(self, rejections: Rejections) -> None:
        self.rejections = rejections

    def collect(self) -> Iterator[CounterFamily]:
        family = CounterFamily(
            "radix_router_untrusted_rejected",
            "Entries read from Redis and dropped as malformed or out of bounds",
            labels=["source"],
        )
        for source, count in sorted(self.rejections.counts.items()):
            family.add_metric([source], count)
        yield family


class _KvFeedCollector(Collector):
    """The KV-event index: its size, each worker's trust status, what was dropped."""

    def __init__(self, feed: KvFeedView) -> None:
        self.feed = feed

    def collect(self) -> Iterator[Family]:
        feed = self.feed
        blocks = GaugeFamily(
            "radix_router_kv_index_blocks", "Token blocks in the KV-event index", labels=["model"]
        )
        for model, index in sorted(feed.indexes.items()):
            blocks.add_metric([model], len(index))
        yield blocks
        status = GaugeFamily(
            "radix_router_kv_events_status",
            "1 for each worker's KV-event status (ok: its index is used; else the tree)",
            labels=["worker", "status"],
        )
        for wid, state in sorted(feed.streams.items()):
            status.add_metric([wid, state.status], 1)
        yield status
        dropped = CounterFamily(
            "radix_router_kv_events_dropped",
            "KV-event stream entries dropped (malformed, oversized, other_worker, gap, ...)",
            labels=["reason"],
        )
        for reason, count in sorted(feed.dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
        rebuilds = CounterFamily(
            "radix_router_kv_events_rebuilds",
            "Workers' indexes emptied and rebuilt after lost events, by cause (marker: the "
            "writer could not recover a gap; gap: a sequence jump seen here)",
            labels=["cause"],
        )
        for cause, count in sorted(feed.rebuilds.items()):
            rebuilds.add_metric([cause], count)
        yield rebuilds
        progress = GaugeFamily(
            "radix_router_kv_events_rebuild_progress",
            "Of a rebuilding worker: GPU blocks removed since the loss / its pool's blocks "
            "(trusted alone again at 1; 0 while its capacity is unknown)",
            labels=["worker"],
        )
        for wid, state in sorted(feed.streams.items()):
            rebuild = feed.rebuild_of(wid) if state.status == "rebuilding" else None
            if rebuild is not None:
                share = min(1.0, rebuild.removed / rebuild.needed) if rebuild.needed else 0.0
                progress.add_metric([wid], share)
        yield progress


class _PoolCollector(Collector):
    """The upstream pool's connections: how often keep-alive saves a connect, and how
    often a worker closed a kept connection under a request (resent, not its failure)."""

    def __init__(self, pool: PoolCounts, fleet: WorkerTable) -> None:
        self.pool = pool
        self.fleet = fleet

    def collect(self) -> Iterator[Family]:
        # Which workers do not echo x-request-id: each of their answers costs the next
        # request a new connection (router/upstream/echo.py).
        echoes = GaugeFamily(
            "radix_router_worker_echoes_request_id",
            "1: the worker's last answer echoed x-request-id (its connections are reused); "
            "0: it did not (a new connection per request; vLLM: --enable-request-id-headers)",
            labels=["worker"],
        )
        unechoed = CounterFamily(
            "radix_router_worker_unechoed_answers",
            "Answers without the x-request-id echo: each cost a new upstream connection",
            labels=["worker"],
        )
        book = self.pool.echo
        for wid, worker in sorted(self.fleet.workers.items()):
            status = book.get(worker.url)
            if status is not None and status.answers:
                echoes.add_metric([wid], 1.0 if status.echoed_last else 0.0)
                unechoed.add_metric([wid], status.unechoed)
        yield echoes
        yield unechoed
        yield CounterFamily(
            "radix_router_upstream_connections_opened",
            "Connections opened to workers for inference requests",
            value=self.pool.connects,
        )
        yield CounterFamily(
            "radix_router_upstream_stale_retries",
            "Requests resent on a fresh connection: the worker closed the kept one first",
            value=self.pool.stale_retries,
        )


class _PinReleasesCollector(Collector):
    """Pins released on workers a session moved off (router/upstream/proxy.py
    `_release_pin`), by outcome: a refused or failed release leaves the pin to its TTL."""

    def __init__(self, releases: Mapping[str, int]) -> None:
        self.releases = releases

    def collect(self) -> Iterator[CounterFamily]:
        family = CounterFamily(
            "radix_router_pin_releases",
            "POST /release_pin to a session's old worker, by outcome: sent (2xx), refused "
            "(answered otherwise), failed (no answer); a pin not released expires by its TTL",
            labels=["outcome"],
        )
        for outcome, count in sorted(self.releases.items()):
            family.add_metric([outcome], count)
        yield family


class RegistryView(Protocol):
    """What the registry gauge reads (router/fleet/discovery.py's Discovery)."""

    unreachable_since: float | None


class _RegistryCollector(Collector):
    """Whether the Redis registry answers: the router routes blind on its last known
    fleet while it does not (helm's RadixRouterRegistryUnreachable alert)."""

    def __init__(self, registry: RegistryView, wall: Callable[[], float]) -> None:
        self.registry = registry
        self.wall = wall

    def collect(self) -> Iterator[GaugeFamily]:
        since = self.registry.unreachable_since
        yield GaugeFamily(
            "radix_router_registry_unreachable",
            "1 while the Redis registry cannot be read (routing on the last known fleet)",
            value=int(since is not None),
        )
        yield GaugeFamily(
            "radix_router_registry_unreachable_seconds",
            "Seconds since the registry was last readable (0 while it is)",
            value=0.0 if since is None else max(0.0, self.wall() - since),
        )


class Metrics(ServiceMetrics):
    def __init__(
        self,
        fleet: WorkerTable,
        clock: Callable[[], float] = time.monotonic,
        in_flight: Callable[[], int] = lambda: 0,
        rejections: Rejections | None = None,
    ) -> None:
        super().__init__("radix_router")
        self.clock = clock
        self.started_wall = time.time()  # the counters below count from here
        self.reasons = ReasonWindow()
        self._decided: dict[str, CounterChild] = {}  # `decisions`' children by reason
        self._done: dict[tuple[str, int], tuple[CounterChild, HistogramChild]] = {}
        # `worker_requests`' children by (worker, status): as bounded as `child`'s own
        # table, without its key tuple and str(status) per answer.
        self._answered: dict[tuple[str, int], CounterChild] = {}
        self._ratio: dict[str, HistogramChild] = {}  # `cached_tokens_ratio`'s, by worker
        r = self.registry
        self.retries = Counter(
            "radix_router_retries", "Attempts retried on another worker", registry=r
        )
        self.foreign_retries = Counter(
            "radix_router_upstream_foreign_answer_retries",
            "Requests resent once on a fresh connection: another answer's bytes broke theirs "
            "before anything reached their client",
            registry=r,
        )
        # Per request, on the loop: no lock per update (shared/serving/loop_metrics.py).
        self.decisions = LoopCounter(
            "radix_router_decisions", "Routing decisions", ["reason"], registry=r
        )
        self.rejected = LoopCounter(
            "radix_router_rejected",
            "Requests refused before reaching a worker (rate limit, capacity, draining)",
            ["reason"],
            registry=r,
        )
        self.worker_requests = LoopCounter(
            "radix_router_worker_requests", "Requests answered, by the worker that answered",
            ["worker", "status"], registry=r,
        )  # fmt: skip
        self.cache_ratio = LoopHistogram(
            "radix_router_cached_tokens_ratio",
            "Actual cached tokens / tokens predicted by the prefix tree (when predicted > 0)",
            ["worker"], buckets=RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self._fleet = fleet
        r.register(_FleetCollector(fleet, clock, in_flight))
        if rejections is not None:
            r.register(_RejectionsCollector(rejections))

    def watch_kv_feed(self, feed: KvFeedView) -> None:
        self.registry.register(_KvFeedCollector(feed))

    def watch_registry(self, state: RegistryView, wall: Callable[[], float] = time.time) -> None:
        self.registry.register(_RegistryCollector(state, wall))

    def watch_pool(self, pool: PoolCounts) -> None:
        self.registry.register(_PoolCollector(pool, self._fleet))

    def watch_pin_releases(self, releases: Mapping[str, int]) -> None:
        self.registry.register(_PinReleasesCollector(releases))

    # The updates below run on every request. Their children are kept by label values
    # and found by `[]` (a miss, the first of each, raises once), and a counter is
    # bumped in place (`CounterChild.value`, its `inc` without the call).
    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        """ServiceMetrics' two updates, with their children kept by (endpoint, status)."""
        try:
            counted, latency = self._done[endpoint, status]
        except KeyError:  # endpoints are three, statuses the few HTTP ones answered
            counted, latency = self._done[endpoint, status] = (
                self.child(self.requests, endpoint, str(status)), self.child(self.latency, endpoint),
            )  # fmt: skip
        counted.value += 1.0
        # `HistogramChild.observe`, written here (a call less a request)
        latency.counts[bisect_left(latency.bounds, seconds)] += 1
        latency.sum += seconds

    def answered(self, worker: str, status: int) -> None:
        try:
            counted = self._answered[worker, status]
        except KeyError:
            counted = self._answered[worker, status] = self.child(
                self.worker_requests, worker, str(status)
            )
        counted.value += 1.0

    def refused(self, reason: str) -> None:
        self.child(self.rejected, reason).inc()

    def decision(self, reason: str, now: float | None = None) -> None:
        """One routing decision (`now`: the caller's clock reading, read here if None)."""
        try:
            counted = self._decided[reason]
        except KeyError:  # reasons are a handful of constants (policy/base.py)
            counted = self._decided[reason] = self.child(self.decisions, reason)
        counted.value += 1.0
        if now is None:
            now = self.clock()
        window = self.reasons
        if now // window.bucket_s == window.current_at:  # (`ReasonWindow.add`'s own test)
            window.current[reason] += 1
        else:
            window.add(reason, now)

    def observe_cached(self, worker_id: str, predicted_tokens: float, actual: int) -> None:
        """The ratio histogram (the totals are the fleet's, read at scrape time)."""
        if predicted_tokens > 0:
            try:
                ratio = self._ratio[worker_id]
            except KeyError:
                ratio = self._ratio[worker_id] = self.child(self.cache_ratio, worker_id)
            value = actual / predicted_tokens  # `HistogramChild.observe`, written here
            ratio.counts[bisect_left(ratio.bounds, value)] += 1
            ratio.sum += value
