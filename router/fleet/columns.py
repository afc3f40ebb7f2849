"""The policy's columns over the worker table, kept between requests.

Building a `FleetView` is O(fleet) in Python (~640 µs at 1,000 workers: twice the
router's whole CPU budget), so the views are kept and each event costs only what it
touches:

    event                                            cost
    ───────────────────────────────────────────────  ──────────────────────────────────
    an attempt starts or ends; heartbeat queue       one load written in place per view
    replica sync replaces the remote in-flight map   the loads of the workers it moved
    join, leave, draining, model, capacity;          `invalidate()`: the views are
      a breaker opens, closes, starts/ends a probe     rebuilt by the next request
    an open breaker's cooldown ends (time, no event) same, at the first request after it

Invariant (tested against the plain definition after every kind of event):
``view(now, model, exclude)`` holds exactly the workers not excluded, not draining,
whose breaker allows a request at ``now`` and that serve ``model`` (or report none), in
table order, with loads ``Worker.load_with(remote)`` and capacities
``kv_capacity_tokens``. A view for a model is the fleet's view when every worker serves
that model (the common case); otherwise one view per served model is kept.

Only the table (`router/fleet/table.py`) calls `invalidate`; the loads move in place through
each worker's `cells` (`Worker.publish_load`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from router.fleet.workers import Worker
from router.policy.base import FleetView

_ALL: str | None = None  # the view key of the whole routable fleet


class Columns:
    """The routable workers of `workers` (the table's own dict) and their views."""

    def __init__(self, workers: Mapping[str, Worker]) -> None:
        self._workers = workers
        # Bumped by every change of who is routable, a model or a capacity.
        self._generation = 0
        self.remote: Mapping[str, int] = {}  # other replicas' in-flight counts per worker
        self._built = -1  # the generation the views were built at
        # The membership holds for `now` in [valid_from, valid_until): until the earliest
        # cooldown end of an open breaker (a transition no event announces).
        self._valid_from, self._valid_until = math.inf, -math.inf
        self._members: list[Worker] = []  # routable workers, table order
        self._views: dict[str | None, FleetView] = {}
        self._reported: tuple[int, frozenset[str]] = (-1, frozenset())

    def invalidate(self) -> None:
        """Who is routable, a model or a capacity changed: rebuild at the next read."""
        self._generation += 1

    def view(
        self,
        now: float,
        model: str | None = None,
        exclude: Iterable[str] = (),
        remote: Mapping[str, int] | None = None,
    ) -> FleetView:
        """What the policy reads (the invariant above). Kept between requests: read only.
        `remote`: other replicas' in-flight counts per worker; its provider replaces the
        mapping when it changes, so the same object means nothing changed."""
        if remote is not None and remote is not self.remote:
            self._set_remote(remote)
        if self._built != self._generation or not self._valid_from <= now < self._valid_until:
            self._rebuild(now)
        key = self._key(model)
        view = self._views.get(key)
        if view is None:
            # Kept: the whole fleet's view and one per reported model. A model nobody
            # reports (the proxy refuses those anyway) gets a one-off, so clients cannot
            # grow this table.
            keep = key is _ALL or key in self.reported_models()
            view = self._build(key, register=keep)
            if keep:
                self._views[key] = view
        skip = set(exclude)
        if not skip:
            return view
        # Retries only (rare): a one-off copy without the workers already tried.
        keep_at = [i for i, wid in enumerate(view.ids) if wid not in skip]
        return FleetView(
            [view.ids[i] for i in keep_at],
            [view.loads[i] for i in keep_at],
            [view.capacities[i] for i in keep_at],
        )

    def reported_models(self) -> frozenset[str]:
        """Every model some worker (routable or not) reports."""
        at, models = self._reported
        if at != self._generation:
            models = frozenset(w.model for w in self._workers.values()) - {""}
            self._reported = (self._generation, models)
        return models

    def _set_remote(self, remote: Mapping[str, int]) -> None:
        old, self.remote = self.remote, remote
        for wid in old.keys() | remote.keys():
            count = remote.get(wid, 0)
            worker = self._workers.get(wid)  # replicas may name workers we dropped
            if worker is not None and count != worker.remote_in_flight:
                worker.remote_in_flight = count
                worker.publish_load()

    def _key(self, model: str | None) -> str | None:
        if model is None:
            return _ALL
        reported = self.reported_models()
        # Workers that report no model serve any: with at most this one model reported,
        # the model's view is the whole fleet's.
        if not reported or (len(reported) == 1 and model in reported):
            return _ALL
        return model

    def _rebuild(self, now: float) -> None:
        members: list[Worker] = []
        until = math.inf
        for w in self._workers.values():
            w.cells = []
            breaker = w.breaker
            if breaker.opened_at is not None:
                end = breaker.half_open_at()
                if now < end:
                    until = min(until, end)
            if not w.draining and breaker.allows(now):
                members.append(w)
        self._members = members
        self._views = {}
        self._built = self._generation
        self._valid_from, self._valid_until = now, until

    def _build(self, model: str | None, register: bool) -> FleetView:
        members = self._members
        if model is not None:
            members = [w for w in members if not w.model or w.model == model]
        ids = tuple(w.worker_id for w in members)
        loads = [w.load_with(w.remote_in_flight) for w in members]
        view = FleetView(ids, loads, tuple(w.kv_capacity_tokens for w in members))
        if register:
            for i, w in enumerate(members):
                w.cells.append((loads, i))
        return view
