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

The policy reads the routable workers as columns kept current between requests
(`router/routable.py`): every change that can move a worker in or out, or change its
load or capacity, reaches that index. So the watched fields of `WorkerState` (model,
draining, running, waiting, capacity, in_flight) are properties that notify it, and a
breaker reports each change of its state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

from router.routable import RoutableViews
from router.worker_state import Breaker, BreakerState, LoadGuard, Source, WorkerState
from router.worker_views import FleetView, WorkerCosts
from shared.config import RouterConfig, check_worker_url
from shared.registry import WorkerRecord

__all__ = ["Breaker", "BreakerState", "Fleet", "LoadGuard", "Source", "WorkerState"]


class PolicyHooks(Protocol):
    """What the fleet tells the policy; `router.policy.Policy` satisfies it."""

    def remove_worker(self, worker_id: str) -> None: ...

    def set_capacity(self, worker_id: str, cache_tokens: int) -> None: ...

    def set_costs(self, worker_id: str, costs: WorkerCosts) -> None: ...


def costs_of(record: WorkerRecord) -> WorkerCosts:
    return WorkerCosts(
        record.queued_prefill_tokens, record.prefill_us_per_token, record.decode_ms_per_token,
        record.max_running_requests, record.request_ms,
    )  # fmt: skip


def static_worker_id(url: str) -> str:
    """Workers given by URL are named by host:port (what an operator would type)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


class Fleet:
    """The worker table. Add and remove workers through its methods (never by editing
    `workers` directly): they keep the routable views in step."""

    def __init__(self, config: RouterConfig, policy: PolicyHooks) -> None:
        self.config = config
        self.policy = policy
        self.workers: dict[str, WorkerState] = {}
        self._views = RoutableViews(self.workers)

    def _new(self, worker_id: str, url: str, source: Source) -> WorkerState:
        index = self._views
        breaker = Breaker(
            self.config.breaker_failures, self.config.breaker_cooldown,
            on_change=index.members_changed,
        )  # fmt: skip
        worker = WorkerState(worker_id=worker_id, url=url, source=source, breaker=breaker)
        worker.listener = index
        self.workers[worker_id] = worker
        index.members_changed()
        return worker

    def add_url(self, url: str, source: Source, worker_id: str | None = None) -> WorkerState:
        url = check_worker_url(url)
        wid = worker_id or static_worker_id(url)
        worker = self.workers.get(wid)
        if worker is None:
            worker = self._new(wid, url, source)
        else:
            worker.url, worker.source = url, source
        return worker

    def remove(self, worker_id: str) -> bool:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        worker.listener = None
        worker.breaker.on_change = None
        self._views.members_changed()
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
                worker = self._new(wid, record.url, "redis")
                joined.append(wid)
            elif worker.epoch and worker.epoch != record.epoch:
                self.policy.remove_worker(wid)
                worker.breaker.record_success()  # a fresh process deserves a fresh chance
                joined.append(wid)
            capacity_changed = worker.cache_capacity_tokens != record.cache_capacity_tokens
            worker.update(record)
            if capacity_changed and record.cache_capacity_tokens:
                self.policy.set_capacity(wid, record.cache_capacity_tokens)
            self.policy.set_costs(wid, costs_of(record))
        if not drop_missing:
            return joined, []
        left = [
            wid for wid, w in self.workers.items() if w.source == "redis" and wid not in records
        ]
        for wid in left:
            self.remove(wid)
        return joined, left

    def view(
        self,
        now: float,
        model: str | None = None,
        exclude: Iterable[str] = (),
        remote: Mapping[str, int] | None = None,
    ) -> FleetView:
        """What the policy reads: `routable(now, exclude, model)` as columns, with loads
        `load_with(remote)`. Kept between requests; do not write to it."""
        if remote is not None:
            self._views.set_remote(remote)
        return self._views.view(now, model, exclude)

    def routable(
        self, now: float, exclude: Iterable[str] = (), model: str | None = None
    ) -> list[WorkerState]:
        """The plain definition of who may take a request (`view` maintains the same)."""
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
        reported = self._views.reported()
        return (
            not reported
            or model in reported
            or (not model and any(not w.model for w in self.workers.values()))
        )

    def models(self) -> list[str]:
        return sorted(self._views.reported())

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers.values())
