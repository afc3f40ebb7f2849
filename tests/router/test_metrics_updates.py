"""The router's per-request metric updates (router/metrics.py `Metrics`: request_done,
answered, decision, observe_cached) write their children in place: the text they
render must be exactly what prometheus_client's own Counter and Histogram render for
the same updates, and the dashboard's decision window must hold what
`ReasonWindow.add` alone would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.fleet.table import Fleet
from router.metrics import RATIO_BUCKETS, Metrics, ReasonWindow
from shared.config import RouterConfig
from shared.serving.metrics import LATENCY_BUCKETS

NAMES = (
    "radix_router_requests", "radix_router_request_duration_seconds",
    "radix_router_worker_requests", "radix_router_decisions", "radix_router_cached_tokens_ratio",
)  # fmt: skip


class Hooks:
    def forget(self, worker_id: str) -> None:
        return

    def answered(self, *args: object) -> None:
        return


def _samples(text: bytes) -> list[str]:
    return sorted(
        line
        for line in text.decode().splitlines()
        if line.startswith(NAMES) and "_created" not in line
    )


def test_request_updates_render_as_prometheus_client_does() -> None:
    ours = Metrics(Fleet(RouterConfig(), Hooks()), clock=lambda: 7.0)
    theirs = CollectorRegistry()
    requests = Counter("radix_router_requests", "", ["endpoint", "status"], registry=theirs)
    latency = Histogram(
        "radix_router_request_duration_seconds", "", ["endpoint"], buckets=LATENCY_BUCKETS,
        registry=theirs,
    )  # fmt: skip
    answered = Counter("radix_router_worker_requests", "", ["worker", "status"], registry=theirs)
    decisions = Counter("radix_router_decisions", "", ["reason"], registry=theirs)
    ratio = Histogram(
        "radix_router_cached_tokens_ratio", "", ["worker"], buckets=RATIO_BUCKETS,
        registry=theirs,
    )  # fmt: skip
    done = [("chat", 200, 0.004), ("chat", 200, 0.3), ("completions", 429, 0.0), ("chat", 499, 61)]
    for endpoint, status, seconds in done * 3:
        ours.request_done(endpoint, status, seconds)
        requests.labels(endpoint, str(status)).inc()
        latency.labels(endpoint).observe(seconds)
    for worker, status in [("w0", 200), ("w1", 200), ("w0", 503), ("w0", 200)]:
        ours.answered(worker, status)
        answered.labels(worker, str(status)).inc()
    for reason, now in [("cache_hit", 1.0), ("balance", None), ("cache_hit", 12.5)]:
        ours.decision(reason, now)
        decisions.labels(reason).inc()
    for worker, predicted, actual in [("w0", 100.0, 100), ("w0", 40.0, 0), ("w1", 0.0, 5)]:
        ours.observe_cached(worker, predicted, actual)
        if predicted > 0:
            ratio.labels(worker).observe(actual / predicted)
    assert _samples(ours.render()) == _samples(generate_latest(theirs))


def test_decisions_fill_the_window_as_its_own_add_does() -> None:
    metrics = Metrics(Fleet(RouterConfig(), Hooks()), clock=lambda: 0.0)
    window = ReasonWindow()
    # Within a bucket, across its edges, back and forth, and past the whole window.
    times = [0.0, 0.5, 9.999, 10.0, 10.0, 19.9, 20.0, 5.0, 300.0, 301.0, 1e6, 1e6 + 0.1]
    for i, now in enumerate(times):
        reason = ("cache_hit", "balance", "no_match")[i % 3]
        metrics.decision(reason, now)
        window.add(reason, now)
        assert metrics.reasons.snapshot(now) == window.snapshot(now)
