"""The policy's columns over the worker table, kept between requests.

Building a `FleetView` is O(fleet) in Python (~640 µs at 1,000 workers: twice the
router's whole CPU budget), so the views are kept and each event costs only what it
touches:

    event                                            cost
    ───────────────────────────────────────────────  ──────────────────────────────────
    an attempt starts or ends                        one load written in place per view
    a heartbeat (routing fields unchanged)           its record and load, in place per view
    replica sync replaces the remote in-flight map   the loads of the workers it moved
      (read from the provider the table was given)
    join, leave, draining, model, capacity;          `invalidate()`: the views are
      a breaker opens, closes, starts/ends a probe     rebuilt by the next request
    an open breaker's cooldown ends (time, no event) same, at the first request after it

Invariant (tested against the plain definition after every kind of event):
``view(now, model, exclude)`` holds exactly the workers not excluded, not draining,
whose breaker allows a request at ``now`` and that serve ``model`` (or report none), in
table order, with loads ``Worker.load_with(remote[id])``, capacities
``report.kv_capacity_tokens + report.host_kv_capacity_tokens`` (both tiers) and each worker's ``report`` and ``reported_at``. A view
for a model is the fleet's view when every worker serves that model (the common case);
otherwise one view per served model is kept.

Only the table (`router/fleet/table.py`) calls `invalidate`, `publish` (a worker's load
moved) and `report` (a heartbeat); the cells each worker's figures are written to are
kept here, not on the worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from router.fleet.view import FleetView
from router.fleet.workers import Worker

NO_REMOTE: Mapping[str, int] = MappingProxyType({})  # a lone router: no other replica's load


class FleetColumns:
    """The routable workers of `workers` (the table's own dict) and their views."""

    def __init__(
        self, workers: Mapping[str, Worker], remote: Callable[[], Mapping[str, int]] | None
    ) -> None:
        self._workers = workers
        # Bumped by every change of who is routable, a model or a capacity.
        self._generation = 0
        # Other replicas' in-flight counts per worker: `remote()` returns the same mapping
        # until it changes (its provider replaces it), so identity means "nothing moved".
        # None: a lone router (no call a view).
        self._remote_of = remote
        self.remote: Mapping[str, int] = NO_REMOTE
        # (view, index) of every kept view holding a worker: where `publish` writes its
        # load. Keyed by the Worker itself, so a request still in flight to a worker that
        # left (and was replaced under the same id) writes nowhere.
        self._cells: dict[Worker, list[tuple[FleetView, int]]] = {}
        self._built = -1  # the generation the views were built at
        # The membership holds for `now` in [valid_from, valid_until): until the earliest
        # cooldown end of an open breaker (a transition no event announces).
        self._valid_from, self._valid_until = math.inf, -math.inf
        self._members: list[Worker] = []  # routable workers, table order
        self._whole: FleetView | None = None  # the whole routable fleet's view
        self._views: dict[str, FleetView] = {}  # a model's, where it is not the whole's
        # (models, adapters, whole) as the workers report them, read at the first ask
        # after an `invalidate` (None until then): `names or read_names()` (the table
        # reads them so too: one call less a request for each of its two questions).
        self.names: tuple[frozenset[str], frozenset[str], frozenset[str] | None] | None = None

    def invalidate(self) -> None:
        """Who is routable, a model or a capacity changed: rebuild at the next read."""
        self._generation += 1
        self.names = None

    def publish(self, worker: Worker) -> None:
        """`worker`'s load moved: write it into every kept view holding it."""
        cells = self._cells
        if worker in cells:  # (`in`, not `get`: no call on every attempt's start and end)
            remote = self.remote
            # `Worker.load_with`, written here: a call less on every attempt's start and end.
            ours = worker.in_flight + (remote.get(worker.worker_id, 0) if remote else 0)
            report = worker.report
            reported = report.running + report.waiting
            load = ours if ours >= reported else reported
            for view, i in cells[worker]:
                view.loads[i] = load

    def report(self, worker: Worker) -> None:
        """A heartbeat of `worker` that changed no routing field: its record and load."""
        self.publish(worker)
        for view, i in self._cells.get(worker, ()):
            view.reports[i], view.reported_at[i] = worker.report, worker.reported_at
            view.reported += 1

    def forget(self, worker: Worker) -> None:
        """`worker` left the table: a request still in flight to it writes nowhere."""
        self._cells.pop(worker, None)

    def view(self, now: float, model: str | None = None, exclude: Iterable[str] = ()) -> FleetView:
        """What the policy reads (the invariant above). Kept between requests: read only."""
        if self._remote_of is not None:
            remote = self._remote_of()
            if remote is not self.remote:
                self._set_remote(remote)
        if self._built != self._generation or not self._valid_from <= now < self._valid_until:
            self._rebuild(now)
        view = None
        if model is not None:
            # Workers that report no model serve any: with at most this one model
            # reported, the model's view is the whole fleet's (`read_names`' whole).
            models, _, whole = self.names or self.read_names()
            if whole is not None and model not in whole:
                view = self._views.get(model)
                if view is None:
                    # Kept: one per reported model. A model nobody reports (the proxy
                    # refuses those anyway) gets a one-off, so clients cannot grow this.
                    keep = model in models
                    view = self._build(model, register=keep)
                    if keep:
                        self._views[model] = view
        if view is None:
            view = self._whole
            if view is None:
                view = self._whole = self._build(None, register=True)
        if not exclude:  # (every first try: no set built)
            return view
        skip = set(exclude)
        if not skip:
            return view
        # Retries only (rare): a one-off copy without the workers already tried.
        keep_at = [i for i, wid in enumerate(view.ids) if wid not in skip]
        return FleetView(
            [view.ids[i] for i in keep_at],
            [view.loads[i] for i in keep_at],
            [view.capacities[i] for i in keep_at],
            [view.reports[i] for i in keep_at],
            [view.reported_at[i] for i in keep_at],
        )

    def reported_models(self) -> frozenset[str]:
        """Every model some worker (routable or not) reports, its adapters included."""
        return (self.names or self.read_names())[0]

    def read_names(self) -> tuple[frozenset[str], frozenset[str], frozenset[str] | None]:
        """(models, adapters, whole), kept as `names` until the next `invalidate` (every
        change of a model or adapters calls it):
        - models: `reported_models`;
        - adapters: every name some worker serves as a LoRA adapter
          (`WorkerRecord.adapters`) and none as its base model: a worker credential that
          lists a base model's name among its adapters cannot move that model's requests
          out of their default namespace (and so off the KV-event index) for the whole
          fleet;
        - whole: the models whose view is the whole fleet's: None for every model (no
          worker reports one: those serve any), the one model where exactly one is
          reported, else none."""
        reports = [w.report for w in self._workers.values()]
        bases = frozenset(r.model for r in reports) - {""}
        listed = frozenset(a for r in reports for a in r.adapters)
        models = bases | listed
        whole = None if not models else models if len(models) == 1 else frozenset()
        self.names = names = (models, listed - bases, whole)
        return names

    def _set_remote(self, remote: Mapping[str, int]) -> None:
        old, self.remote = self.remote, remote
        for wid in old.keys() | remote.keys():
            worker = self._workers.get(wid)  # replicas may name workers we dropped
            if worker is not None and remote.get(wid, 0) != old.get(wid, 0):
                self.publish(worker)

    def _rebuild(self, now: float) -> None:
        members: list[Worker] = []
        until = math.inf
        self._cells = {}
        for w in self._workers.values():
            breaker = w.breaker
            if breaker.opened_at is not None:
                end = breaker.half_open_at()
                if now < end:
                    until = min(until, end)
            if not w.report.draining and breaker.allows(now):
                members.append(w)
        self._members = members
        self._whole, self._views = None, {}
        self._built = self._generation
        self._valid_from, self._valid_until = now, until

    def _build(self, model: str | None, register: bool) -> FleetView:
        members = self._members
        if model is not None:
            members = [
                w
                for w in members
                if not w.report.model or w.report.model == model or model in w.report.adapters
            ]
        ids = tuple(w.worker_id for w in members)
        remote = self.remote
        loads = [w.load_with(remote.get(w.worker_id, 0)) for w in members]
        view = FleetView(
            ids,
            loads,
            # A worker's tree cap follows what it caches in both tiers.
            tuple(w.report.kv_capacity_tokens + w.report.host_kv_capacity_tokens for w in members),
            [w.report for w in members],
            [w.reported_at for w in members],
        )
        if register:
            cells = self._cells
            for i, w in enumerate(members):
                cells.setdefault(w, []).append((view, i))
        return view
