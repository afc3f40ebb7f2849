"""The router's table of workers and its books.

Workers come from three sources: the Redis registry (heartbeats), a static list
(`worker_urls`), and the admin API. Only registry workers come and go with the
registry; the other two stay until removed by hand. What one worker's numbers mean
(load, breaker states) is documented in `router/fleet/workers.py`.

The table keeps its own books: every write to a worker goes through a method here.
The proxy asks (`attempt`, then `succeeded` or `failed(kind)`), metrics and handlers
only read. That is what lets the policy's columns (`router/fleet/columns.py`) be kept between
requests instead of rebuilt: every change of who is routable, a model or a capacity
calls `columns.invalidate()`, and nothing else does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

from router.fleet.columns import Columns
from router.fleet.workers import Breaker, FailureKind, LoadGuard, Source, Worker
from router.policy.base import FleetView, WorkerCosts
from shared.config import RouterConfig, check_worker_url
from shared.registry import WorkerRecord


class PolicyHooks(Protocol):
    """What the table tells the policy; `router.policy.base.Policy` satisfies it."""

    def remove_worker(self, worker_id: str) -> None: ...

    def set_costs(self, worker_id: str, costs: WorkerCosts) -> None: ...


def costs_of(record: WorkerRecord) -> WorkerCosts:
    return WorkerCosts(
        record.queued_prefill_tokens, record.prefill_us_per_token, record.decode_ms_per_token,
        record.max_running_requests, record.request_ms,
        record.cached_tokens_total / record.prompt_tokens_total if record.prompt_tokens_total else 0.0,
    )  # fmt: skip


def static_worker_id(url: str) -> str:
    """Workers given by URL are named by host:port (what an operator would type)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


class Attempt:
    """One try of one request on one worker: holds its load from `Fleet.attempt` until
    `release` (idempotent; also the `with` exit), and notes whether it is the breaker's
    half-open probe, so a probe that ends without a verdict lets the next one through."""

    __slots__ = ("_fleet", "guard", "probe", "worker")

    def __init__(self, fleet: Fleet, worker: Worker, probe: bool) -> None:
        self._fleet, self.worker, self.probe = fleet, worker, probe
        self.guard = LoadGuard(worker)

    def release(self) -> None:
        self.guard.release()
        if self.probe and self.worker.breaker.probing:
            self.worker.breaker.abandon_probe()
            self._fleet.columns.invalidate()

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Fleet:
    """The worker table. `workers` is for reading; change it through the methods."""

    def __init__(self, config: RouterConfig, policy: PolicyHooks) -> None:
        self.config = config
        self.policy = policy
        self.workers: dict[str, Worker] = {}
        self.columns = Columns(self.workers)

    # -- membership --------------------------------------------------------------------
    def add_url(self, url: str, source: Source, worker_id: str | None = None) -> Worker:
        url = check_worker_url(url)
        wid = worker_id or static_worker_id(url)
        worker = self.workers.get(wid)
        if worker is None:
            return self._new(wid, url, source)
        worker.url, worker.source = url, source
        return worker

    def remove(self, worker_id: str) -> bool:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        worker.cells = []  # a request still in flight to it cannot touch the columns
        self.columns.invalidate()
        self.policy.remove_worker(worker_id)
        return True

    def apply_registry(
        self, records: dict[str, WorkerRecord], drop_missing: bool = True
    ) -> tuple[list[str], list[str]]:
        """Bring registry-sourced workers in line with a full read of the registry.

        Returns (joined or restarted, left). A changed epoch means the worker restarted
        with an empty cache, so its tree is dropped and its breaker closed.
        """
        joined: list[str] = []
        for wid, record in records.items():
            worker = self.workers.get(wid)
            if worker is None:
                worker = self._new(wid, record.url, "redis")
                joined.append(wid)
            elif worker.epoch and worker.epoch != record.epoch:
                self.policy.remove_worker(wid)
                worker.breaker.record_success()  # a fresh process deserves a fresh chance
                self.columns.invalidate()
                joined.append(wid)
            self._report(worker, record)
            self.policy.set_costs(wid, costs_of(record))
        if not drop_missing:
            return joined, []
        left = [
            wid for wid, w in self.workers.items() if w.source == "redis" and wid not in records
        ]
        for wid in left:
            self.remove(wid)
        return joined, left

    def set_model(self, worker: Worker, model: str) -> None:
        """A model learnt by asking the worker (static and admin ones report none)."""
        if model != worker.model:
            worker.model = model
            self.columns.invalidate()

    def _new(self, worker_id: str, url: str, source: Source) -> Worker:
        breaker = Breaker(self.config.breaker_failures, self.config.breaker_cooldown)
        worker = Worker(worker_id=worker_id, url=url, source=source, breaker=breaker)
        worker.remote_in_flight = self.columns.remote.get(worker_id, 0)
        self.workers[worker_id] = worker
        self.columns.invalidate()
        return worker

    def _report(self, w: Worker, r: WorkerRecord) -> None:
        routing = (r.model, r.draining, r.kv_capacity_tokens)
        if routing != (w.model, w.draining, w.kv_capacity_tokens):
            w.model, w.draining, w.kv_capacity_tokens = routing
            self.columns.invalidate()  # a view's capacities column is replaced, not edited
        w.url, w.engine, w.epoch = r.url, r.engine, r.epoch
        w.kv_used_tokens = r.kv_used_tokens
        w.host_kv_capacity_tokens, w.host_kv_used_tokens = (
            r.host_kv_capacity_tokens,
            r.host_kv_used_tokens,
        )
        w.host_cached_tokens_total = r.host_cached_tokens_total
        w.host_load_bytes_per_s, w.kv_bytes_per_token = (
            r.host_load_bytes_per_s,
            r.kv_bytes_per_token,
        )
        w.prompt_tokens_total, w.cached_tokens_total = r.prompt_tokens_total, r.cached_tokens_total
        if (r.running, r.waiting) != (w.running, w.waiting):
            w.running, w.waiting = r.running, r.waiting
            w.publish_load()

    # -- the books: what the proxy asks ------------------------------------------------
    def attempt(self, worker: Worker, now: float) -> Attempt:
        """Start one try on `worker` (chosen from `view`); release it when it ends."""
        probe = worker.breaker.on_attempt(now)
        if probe:
            self.columns.invalidate()  # a probing worker takes nothing else
        return Attempt(self, worker, probe)

    def succeeded(
        self, attempt: Attempt, predicted_tokens: float = 0.0, cached_tokens: int | None = None
    ) -> None:
        """The worker answered; `cached_tokens` is what it reports having reused, against
        `predicted_tokens` (the tree's guess) when known."""
        worker, breaker = attempt.worker, attempt.worker.breaker
        if breaker.opened_at is not None or breaker.probing:
            self.columns.invalidate()
        breaker.record_success()
        if cached_tokens is not None:
            worker.predicted_tokens_total += predicted_tokens
            worker.actual_cached_tokens_total += cached_tokens

    def failed(self, attempt: Attempt, kind: FailureKind, now: float) -> None:
        """The try failed (see `FailureKind`). A busy worker is alive: BUSY counts toward no
        breaker (a worker's 503 "overloaded" used to), every other kind does."""
        if kind is FailureKind.BUSY:
            return
        worker, breaker = attempt.worker, attempt.worker.breaker
        worker.failures_total += 1
        before = (breaker.opened_at, breaker.probing)
        breaker.record_failure(now)
        if (breaker.opened_at, breaker.probing) != before:
            self.columns.invalidate()

    # -- reads -------------------------------------------------------------------------
    def view(
        self,
        now: float,
        model: str | None = None,
        exclude: Iterable[str] = (),
        remote: Mapping[str, int] | None = None,
    ) -> FleetView:
        """What the policy reads: see `Columns.view`. Read only."""
        return self.columns.view(now, model, exclude, remote)

    def knows_model(self, model: str) -> bool:
        """Whether some worker serves `model`; True too while no worker reports a model."""
        reported = self.columns.reported_models()
        return (
            not reported
            or model in reported
            or (not model and any(not w.model for w in self.workers.values()))
        )

    def models(self) -> list[str]:
        return sorted(self.columns.reported_models())

    def in_flight_by_worker(self) -> dict[str, int]:
        """This router's requests in flight per worker (what replica sync shares)."""
        return {wid: w.in_flight for wid, w in self.workers.items()}
