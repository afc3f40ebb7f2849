"""One worker as the router knows it: what it reported, its breaker, its requests in flight.

Load, as the policy sees it, is `max(in_flight + remote, running + waiting)`: requests
this router (plus, with replica sync, the other replicas) has in flight to the worker,
exact and instant (counted by the table's `Attempt`), or the queue the worker last reported in
its heartbeat, which includes every router's traffic but is up to one heartbeat stale.
Taking the larger of the two counts no request twice (the reported queue already holds
this router's requests) and still sees replicas without sync.

Circuit breaker per worker:

    closed ──(breaker_failures consecutive failures)──▶ open
    open ──(breaker_cooldown elapsed)──▶ half-open: one probe request at a time
    half-open ──probe succeeds──▶ closed      half-open ──probe fails──▶ open

Only the table (`router/fleet/table.py`) writes these fields, loads included (its
`Attempt` counts a request in flight); everyone else reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from shared.wire.registry import WorkerRecord

Source = Literal["redis", "static", "admin"]
BreakerState = Literal["closed", "open", "half_open"]


class FailureKind(enum.Enum):
    """Why an attempt to a worker failed before the client got a byte (or mid-stream).

    Every kind but BUSY counts toward the worker's breaker (`Fleet.failed`): a busy
    worker is healthy, a refused connection is not. Which answers are which is
    `router/upstream/answers.py`.
    """

    CONNECT = "connect"  # no connection: refused, reset or unreachable before a status
    TIMEOUT = "timeout"  # no byte within request_timeout (first byte or next chunk)
    UPSTREAM_5XX = "upstream_5xx"  # the worker answered 5xx (and did not say it is busy)
    BUSY = "busy"  # 503 with Retry-After, or an "overloaded" answer: alive but full
    BROKEN = "broken"  # the body or stream was cut short after the status line
    BAD_ANSWER = "bad_answer"  # a redirect, a content type not JSON/SSE, an oversized body


@dataclass
class Breaker:
    failures_to_open: int
    cooldown: float
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # a half-open probe is in flight

    def half_open_at(self) -> float:
        """When an open breaker lets a probe through (only meaningful while open)."""
        assert self.opened_at is not None
        return self.opened_at + self.cooldown

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        # Written against `half_open_at()` so the fleet's view, which refreshes when
        # `now` reaches that instant, agrees with this to the last bit.
        return "open" if now < self.half_open_at() else "half_open"

    def allows(self, now: float) -> bool:
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.probing)

    def on_attempt(self, now: float) -> bool:
        """Note an attempt; True when it is the half-open probe."""
        if self.state(now) == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def abandon_probe(self) -> None:
        """The probe ended without a verdict (client left): let the next request probe."""
        self.probing = False

    def record_success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def record_failure(self, now: float) -> None:
        self.failures += 1
        # Open after N in a row. A failed probe re-opens at once too: only a success
        # resets the count, so a breaker that opened is still at N or more.
        if self.failures >= self.failures_to_open:
            self.opened_at = now
        self.probing = False


@dataclass(eq=False)
class Worker:
    worker_id: str
    url: str
    source: Source
    breaker: Breaker
    # Its last heartbeat as the registry holds it (one shape from the worker to the
    # policy), and when this router read it. A worker added by URL reports none: a blank
    # record whose model the router may learn by asking (`Fleet.set_model`).
    report: WorkerRecord
    reported_at: float = 0.0
    in_flight: int = 0
    requests_total: int = 0
    failures_total: int = 0
    predicted_tokens_total: float = 0.0
    actual_cached_tokens_total: int = 0
    # Learned from its answers where the router has no tokenizer (router/holdings/calibration.py).
    chars_per_token: float | None = None
    calibration_rejected_total: int = 0

    @property
    def load(self) -> int:
        """This router's view of the load (no other replica's requests)."""
        return self.load_with(0)

    def load_with(self, remote_in_flight: int) -> int:
        report = self.report
        ours, reported = self.in_flight + remote_in_flight, report.running + report.waiting
        return ours if ours >= reported else reported  # (max, without its call: every attempt)

    def describe(self, now: float) -> dict[str, object]:
        r = self.report
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "source": self.source,
            "model": r.model,
            "adapters": list(r.adapters),
            "engine": r.engine,
            "epoch": r.epoch,
            "load": self.load,
            "in_flight": self.in_flight,
            "running": r.running,
            "waiting": r.waiting,
            "draining": r.draining,
            "breaker": self.breaker.state(now),
            "kv_capacity_tokens": r.kv_capacity_tokens,
            "kv_used_tokens": r.kv_used_tokens,
            "host_kv_capacity_tokens": r.host_kv_capacity_tokens,
            "host_kv_used_tokens": r.host_kv_used_tokens,
            "host_cached_tokens_total": r.host_cached_tokens_total,
            "host_load_bytes_per_s": r.host_load_bytes_per_s,
            "reported_hit_rate": (
                r.cached_tokens_total / r.prompt_tokens_total if r.prompt_tokens_total else 0.0
            ),
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "predicted_cached_tokens_total": round(self.predicted_tokens_total),
            "actual_cached_tokens_total": self.actual_cached_tokens_total,
            # Learned from its answers where the router has no tokenizer (None: not yet).
            "chars_per_token": self.chars_per_token,
            "calibration_rejected_total": self.calibration_rejected_total,
        }
