"""Loop metrics render exactly as prometheus_client's own (shared/serving/loop_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from shared.serving.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.1, 1, 10)
VALUES = (0.0, 0.005, 0.0051, 0.01, 0.5, 1.0, 3.0, 10.0, 11.0, 1e9)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line and "_created" not in line)


def test_same_samples_as_prometheus_client() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters = (
        Counter("x_requests", "Requests", ["endpoint", "status"], registry=theirs),
        LoopCounter("x_requests", "Requests", ["endpoint", "status"], registry=ours),
    )
    histograms = (
        Histogram("x_seconds", "Time", ["endpoint"], buckets=BUCKETS, registry=theirs),
        LoopHistogram("x_seconds", "Time", ["endpoint"], buckets=BUCKETS, registry=ours),
    )
    for counter in counters:
        counter.labels("chat", "200").inc()
        counter.labels("chat", "200").inc(2)
        counter.labels("generate", "503").inc()
    for histogram in histograms:
        for v in VALUES:
            histogram.labels("chat" if v < 1 else "generate").observe(v)
    assert _samples(ours) == _samples(theirs)


def test_labels_must_match_the_names() -> None:
    counter = LoopCounter("y", "Y", ["a", "b"])
    with pytest.raises(ValueError):
        counter.labels("only-one")
