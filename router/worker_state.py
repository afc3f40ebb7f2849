"""One worker as the router knows it: its reported state, its breaker, its in-flight count.

What these numbers mean (load, breaker states) is documented at the top of
`router/fleet.py`, the table that holds them. The fields the routable view depends on
are properties that tell the fleet's index (`listener`) when they change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from shared.registry import WorkerRecord

Source = Literal["redis", "static", "admin"]
BreakerState = Literal["closed", "open", "half_open"]


class WorkerListener(Protocol):
    """What a worker's changes are told to; `router.routable.RoutableViews` is one."""

    def members_changed(self) -> None: ...

    def load_changed(self, worker: WorkerState) -> None: ...


@dataclass
class Breaker:
    failures_to_open: int
    cooldown: float
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # a half-open probe is in flight
    # Called whenever `opened_at` or `probing` changes (what `allows` depends on).
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

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
            self._set(self.opened_at, probing=True)
            return True
        return False

    def abandon_probe(self) -> None:
        """The probe ended without a verdict (client left): let the next request probe."""
        self._set(self.opened_at, probing=False)

    def record_success(self) -> None:
        self.failures = 0
        self._set(None, probing=False)

    def record_failure(self, now: float) -> None:
        self.failures += 1
        # A failed probe re-opens at once; otherwise open after N in a row.
        if self.probing or self.failures >= self.failures_to_open:
            self._set(now, probing=False)
        else:
            self._set(self.opened_at, probing=False)

    def _set(self, opened_at: float | None, probing: bool) -> None:
        if opened_at != self.opened_at or probing != self.probing:
            self.opened_at, self.probing = opened_at, probing
            if self.on_change is not None:
                self.on_change()


@dataclass
class WorkerState:
    worker_id: str
    url: str
    source: Source
    breaker: Breaker
    epoch: float = 0.0
    engine: str = ""
    cache_used_tokens: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    requests_total: int = 0
    failures_total: int = 0
    predicted_tokens_total: float = 0.0
    actual_cached_tokens_total: int = 0
    # Watched fields, read and written through the properties below.
    _model: str = field(default="", init=False, repr=False)
    _draining: bool = field(default=False, init=False, repr=False)
    _capacity: int = field(default=0, init=False, repr=False)
    _running: int = field(default=0, init=False, repr=False)
    _waiting: int = field(default=0, init=False, repr=False)
    _in_flight: int = field(default=0, init=False, repr=False)
    # The fleet's index while this worker is in the table; None once removed, so a
    # request still in flight to a removed worker cannot touch its successor's load.
    listener: WorkerListener | None = field(default=None, repr=False, compare=False)

    @property
    def load(self) -> int:
        return self.load_with(0)

    def load_with(self, remote_in_flight: int) -> int:
        return max(self._in_flight + remote_in_flight, self._running + self._waiting)

    def _members_changed(self) -> None:
        if self.listener is not None:
            self.listener.members_changed()

    def _load_changed(self) -> None:
        if self.listener is not None:
            self.listener.load_changed(self)

    @property
    def model(self) -> str:
        return self._model

    @model.setter
    def model(self, value: str) -> None:
        if value != self._model:
            self._model = value
            self._members_changed()

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        if value != self._draining:
            self._draining = value
            self._members_changed()

    @property
    def cache_capacity_tokens(self) -> int:
        return self._capacity

    @cache_capacity_tokens.setter
    def cache_capacity_tokens(self, value: int) -> None:
        if value != self._capacity:
            self._capacity = value
            self._members_changed()  # a view's capacities column is replaced, not edited

    @property
    def running(self) -> int:
        return self._running

    @running.setter
    def running(self, value: int) -> None:
        self._running = value
        self._load_changed()

    @property
    def waiting(self) -> int:
        return self._waiting

    @waiting.setter
    def waiting(self, value: int) -> None:
        self._waiting = value
        self._load_changed()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        self._load_changed()

    def update(self, record: WorkerRecord) -> None:
        self.url = record.url
        self.model = record.model
        self.engine = record.engine
        self.epoch = record.epoch
        if (record.running, record.waiting) != (self._running, self._waiting):
            self._running, self._waiting = record.running, record.waiting
            self._load_changed()  # once for both
        self.cache_capacity_tokens = record.cache_capacity_tokens
        self.cache_used_tokens = record.cache_used_tokens
        self.prompt_tokens_total = record.prompt_tokens_total
        self.cached_tokens_total = record.cached_tokens_total
        self.draining = record.draining

    def describe(self, now: float) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "source": self.source,
            "model": self.model,
            "engine": self.engine,
            "epoch": self.epoch,
            "load": self.load,
            "in_flight": self.in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "draining": self.draining,
            "breaker": self.breaker.state(now),
            "cache_capacity_tokens": self.cache_capacity_tokens,
            "cache_used_tokens": self.cache_used_tokens,
            "reported_hit_rate": (
                self.cached_tokens_total / self.prompt_tokens_total
                if self.prompt_tokens_total
                else 0.0
            ),
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "predicted_cached_tokens_total": round(self.predicted_tokens_total),
            "actual_cached_tokens_total": self.actual_cached_tokens_total,
        }


class LoadGuard:
    """Counts one request in flight to a worker, from before it is sent until `release`.

    Release is idempotent, so every exit path (body end, error, cancel, timeout, retry)
    may call it and the count still drops exactly once. It holds the WorkerState
    itself, so a worker removed from the table mid-request is still decremented.
    """

    __slots__ = ("_released", "worker")

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker
        self._released = False
        worker.in_flight += 1
        worker.requests_total += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.worker.in_flight -= 1

    def __enter__(self) -> LoadGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
