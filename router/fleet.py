"""The router's table of workers: who they are, how loaded, whether they may be routed to.

Workers come from three sources: the Redis registry (heartbeats), a static list
(`worker_urls`), and the admin API. Only registry workers come and go with the
registry; the other two stay until removed by hand.

Load, as the policy sees it, is `max(in_flight + remote, running + waiting)`:
requests this router (plus, with replica sync, the other replicas) has in flight to
the worker, exact and instant (counted by `LoadGuard`), or the queue the worker last
reported in its heartbeat, which includes every router's traffic but is up to one
heartbeat stale. Taking the larger of the two counts no request twice (the reported
queue already holds this router's requests) and still sees replicas without sync.

Circuit breaker per worker:

    closed ──(breaker_failures consecutive failures)──▶ open
    open ──(breaker_cooldown elapsed)──▶ half-open: one probe request at a time
    half-open ──probe succeeds──▶ closed      half-open ──probe fails──▶ open
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import urlsplit

from shared.config import RouterConfig, check_worker_url
from shared.registry import WorkerRecord

Source = Literal["redis", "static", "admin"]
BreakerState = Literal["closed", "open", "half_open"]


class PolicyHooks(Protocol):
    """What the fleet tells the policy; `router.policy.Policy` satisfies it."""

    def remove_worker(self, worker_id: str) -> None: ...

    def set_capacity(self, worker_id: str, cache_tokens: int) -> None: ...


@dataclass
class Breaker:
    failures_to_open: int
    cooldown: float
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # a half-open probe is in flight

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        return "open" if now - self.opened_at < self.cooldown else "half_open"

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
        self.failures = 0
        self.opened_at = None
        self.probing = False

    def record_failure(self, now: float) -> None:
        self.failures += 1
        # A failed probe re-opens at once; otherwise open after N in a row.
        if self.probing or self.failures >= self.failures_to_open:
            self.opened_at = now
        self.probing = False


@dataclass
class WorkerState:
    worker_id: str
    url: str
    source: Source
    breaker: Breaker
    epoch: float = 0.0
    model: str = ""
    engine: str = ""
    running: int = 0
    waiting: int = 0
    cache_capacity_tokens: int = 0
    cache_used_tokens: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    draining: bool = False
    in_flight: int = 0
    requests_total: int = 0
    failures_total: int = 0
    predicted_tokens_total: float = 0.0
    actual_cached_tokens_total: int = 0

    @property
    def load(self) -> int:
        return self.load_with(0)

    def load_with(self, remote_in_flight: int) -> int:
        return max(self.in_flight + remote_in_flight, self.running + self.waiting)

    def update(self, record: WorkerRecord) -> None:
        self.url = record.url
        self.model = record.model
        self.engine = record.engine
        self.epoch = record.epoch
        self.running = record.running
        self.waiting = record.waiting
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


def static_worker_id(url: str) -> str:
    """Workers given by URL are named by host:port (what an operator would type)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


@dataclass
class Fleet:
    config: RouterConfig
    policy: PolicyHooks
    workers: dict[str, WorkerState] = field(default_factory=dict)

    def _new(self, worker_id: str, url: str, source: Source) -> WorkerState:
        breaker = Breaker(self.config.breaker_failures, self.config.breaker_cooldown)
        return WorkerState(worker_id=worker_id, url=url, source=source, breaker=breaker)

    def add_url(self, url: str, source: Source, worker_id: str | None = None) -> WorkerState:
        url = check_worker_url(url)
        wid = worker_id or static_worker_id(url)
        worker = self.workers.get(wid)
        if worker is None:
            worker = self.workers[wid] = self._new(wid, url, source)
        else:
            worker.url, worker.source = url, source
        return worker

    def remove(self, worker_id: str) -> bool:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        self.policy.remove_worker(worker_id)
        return True

    def apply_registry(
        self, records: dict[str, WorkerRecord], drop_missing: bool = True
    ) -> tuple[list[str], list[str]]:
        """Bring registry-sourced workers in line with a full read of the registry.

        Returns (joined or restarted, left). A changed epoch means the worker restarted
        with an empty cache, so its tree is dropped.
        """
        joined: list[str] = []
        for wid, record in records.items():
            worker = self.workers.get(wid)
            if worker is None:
                worker = self.workers[wid] = self._new(wid, record.url, "redis")
                joined.append(wid)
            elif worker.epoch and worker.epoch != record.epoch:
                self.policy.remove_worker(wid)
                worker.breaker.record_success()  # a fresh process deserves a fresh chance
                joined.append(wid)
            capacity_changed = worker.cache_capacity_tokens != record.cache_capacity_tokens
            worker.update(record)
            if capacity_changed and record.cache_capacity_tokens:
                self.policy.set_capacity(wid, record.cache_capacity_tokens)
        if not drop_missing:
            return joined, []
        left = [
            wid for wid, w in self.workers.items() if w.source == "redis" and wid not in records
        ]
        for wid in left:
            self.remove(wid)
        return joined, left

    def routable(
        self, now: float, exclude: Iterable[str] = (), model: str | None = None
    ) -> list[WorkerState]:
        skip = set(exclude)
        return [
            w
            for w in self.workers.values()
            if w.worker_id not in skip
            and not w.draining
            and w.breaker.allows(now)
            and (model is None or not w.model or w.model == model)
        ]

    def knows_model(self, model: str) -> bool:
        """Whether some worker serves `model`; True too while no worker reports a model."""
        reported = False
        for w in self.workers.values():
            if w.model == model:
                return True
            reported = reported or bool(w.model)
        return not reported

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers.values() if w.model})

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers.values())
