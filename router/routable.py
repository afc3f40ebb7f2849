"""The routable workers as `FleetView` columns, kept current between requests.

Building the policy's view from the worker table on every request is O(fleet) in
Python (~640 µs at 1,000 workers: twice the router's whole CPU budget). Instead the
fleet tells this index what changed, and each event costs only what it touches:

    event                                            cost
    ───────────────────────────────────────────────  ──────────────────────────────────
    LoadGuard enter/exit; heartbeat running/waiting  one load written in place per view
    replica sync replaces the remote in-flight map   every load recomputed (per interval)
    join, leave, draining, model, capacity;          views dropped; rebuilt by the next
      a breaker opens, closes, starts/ends a probe     request (one pass over the fleet)
    an open breaker's cooldown ends (time, no event) same, at the first request after it

Invariant (tested against a from-scratch filter after every kind of event): ``view(now,
model)`` holds exactly ``Fleet.routable(now, model=model)``, in table order, with loads
``WorkerState.load_with(remote)`` and capacities ``cache_capacity_tokens``. A view for a
model is the fleet's view when every worker serves that model (the common case);
otherwise one view per served model is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from router.worker_state import WorkerState
from router.worker_views import FleetView

_ALL: str | None = None  # the view key of the whole routable fleet


class RoutableViews:
    """Views of the routable members of ``workers`` (the fleet's own dict, read only)."""

    def __init__(self, workers: Mapping[str, WorkerState]) -> None:
        self._workers = workers
        self._remote: Mapping[str, int] = {}
        self._members: list[WorkerState] = []  # routable workers, table order
        self._views: dict[str | None, FleetView] = {}
        # Where each worker's load lives: (loads column, index) in every view holding it.
        self._slots: dict[str, list[tuple[list[int], int]]] = {}
        self._stale = True
        # The membership holds for `now` in [valid_from, valid_until): until the earliest
        # cooldown end of an open breaker (a transition no event announces).
        self._valid_from = math.inf
        self._valid_until = -math.inf
        self._reported: frozenset[str] | None = None  # models workers report; None: stale

    # -- events (called by the fleet and its workers) ----------------------------------
    def members_changed(self) -> None:
        """Who is routable, a model or a capacity may have changed: rebuild when next read."""
        self._stale = True
        self._reported = None

    def load_changed(self, worker: WorkerState) -> None:
        if self._stale:
            return  # the rebuild computes every load afresh
        slots = self._slots.get(worker.worker_id)
        if slots:
            load = worker.load_with(self._remote.get(worker.worker_id, 0))
            for loads, i in slots:
                loads[i] = load

    def set_remote(self, remote: Mapping[str, int]) -> None:
        """Other router replicas' in-flight counts per worker.

        The provider replaces the mapping when it changes (`DecisionSync` builds a new
        dict every `sync_load_interval`), so the same object means nothing changed.
        """
        if remote is self._remote:
            return
        old, self._remote = self._remote, remote
        if self._stale:
            return  # the rebuild computes every load afresh
        for wid in old.keys() | remote.keys():
            if old.get(wid, 0) != remote.get(wid, 0):
                worker = self._workers.get(wid)  # replicas may name workers we dropped
                if worker is not None:
                    self.load_changed(worker)

    # -- reads (the request path) ------------------------------------------------------
    def view(self, now: float, model: str | None = None, exclude: Iterable[str] = ()) -> FleetView:
        """The routable workers serving ``model`` (None: any), minus ``exclude``."""
        if self._stale or not self._valid_from <= now < self._valid_until:
            self._rebuild(now)
        key = self._key(model)
        view = self._views.get(key)
        if view is None:
            # Kept: the whole fleet's view and one per reported model. A model nobody
            # reports (the proxy refuses those anyway) gets a one-off, so clients cannot
            # grow this table.
            keep = key is _ALL or key in self.reported()
            view = self._build(key, register=keep)
            if keep:
                self._views[key] = view
        skip = set(exclude)
        if not skip:
            return view
        # Retries only (rare): a one-off copy without the workers already tried.
        keep = [i for i, wid in enumerate(view.ids) if wid not in skip]
        return FleetView(
            [view.ids[i] for i in keep],
            [view.loads[i] for i in keep],
            [view.capacities[i] for i in keep],
        )

    def reported(self) -> frozenset[str]:
        """Every model some worker (routable or not) reports."""
        if self._reported is None:
            self._reported = frozenset(w.model for w in self._workers.values()) - {""}
        return self._reported

    # -- internals ---------------------------------------------------------------------
    def _key(self, model: str | None) -> str | None:
        if model is None:
            return _ALL
        reported = self.reported()
        # Workers that report no model serve any: with at most this one model reported,
        # the model's view is the whole fleet's.
        if not reported or (len(reported) == 1 and model in reported):
            return _ALL
        return model

    def _rebuild(self, now: float) -> None:
        members: list[WorkerState] = []
        until = math.inf
        for w in self._workers.values():
            breaker = w.breaker
            if breaker.opened_at is not None:
                end = breaker.half_open_at()
                if now < end:
                    until = min(until, end)
            if not w.draining and breaker.allows(now):
                members.append(w)
        self._members = members
        self._views = {}
        self._slots = {}
        self._stale = False
        self._valid_from, self._valid_until = now, until

    def _build(self, model: str | None, register: bool) -> FleetView:
        members = self._members
        if model is not None:
            members = [w for w in members if not w.model or w.model == model]
        remote = self._remote
        ids = tuple(w.worker_id for w in members)
        loads = [w.load_with(remote.get(w.worker_id, 0)) for w in members]
        view = FleetView(ids, loads, tuple(w.cache_capacity_tokens for w in members))
        if register:
            for i, wid in enumerate(ids):
                self._slots.setdefault(wid, []).append((loads, i))
        return view
