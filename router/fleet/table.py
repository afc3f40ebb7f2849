"""The router's table of workers and its books.

Workers come from three sources: the Redis registry (heartbeats), a static list
(`worker_urls`), and the admin API. Only registry workers come and go with the
registry; the other two stay until removed by hand. What one worker's numbers mean
(load, breaker states) is documented in `router/fleet/workers.py`.

The table keeps its own books: every write to a worker goes through a method here.
The proxy asks (`attempt`, then `succeeded` or `failed(kind)`), metrics and handlers
only read. That is what lets the policy's columns (`router/fleet/columns.py`) be kept
between requests instead of rebuilt: every change of who is routable, a model, its
adapters or a capacity calls `columns.invalidate()`, and nothing else does. The table tells the
holdings room (router/holdings/room.py) what concerns a worker's cache: that it left,
restarted or changed model (`forget`), and what each answer reported (`answered`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol
from urllib.parse import urlsplit

from router.fleet.columns import FleetColumns
from router.fleet.view import FleetView
from router.fleet.workers import Breaker, FailureKind, Source, Worker
from router.holdings.calibration import calibrate
from shared.config import RouterConfig, check_worker_url
from shared.wire.registry import WorkerRecord


class HoldingsHooks(Protocol):
    """What the table tells the holdings room (`router.holdings.room.Holdings`). Every
    figure a worker reports reaches the policy in the view (`FleetView.reports`)."""

    def forget(self, worker_id: str) -> None: ...

    def answered(
        self, worker_id: str, predicted: float, cached: int | None,
        chars_per_token: float | None, now: float,
    ) -> None: ...  # fmt: skip


def static_worker_id(url: str) -> str:
    """Workers given by URL are named by host:port (what an operator would type)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


_new_attempt = object.__new__


class Attempt:
    """One try of one request on one worker: counts one request in flight there from
    `Fleet.attempt` until `release`, and notes whether it is the breaker's half-open
    probe, so a probe that ends without a verdict lets the next one through.

    Release is idempotent, so every exit path (body end, error, cancel, timeout, retry)
    may call it and the count still drops exactly once. It holds the Worker itself, so a
    worker removed from the table mid-request is still decremented (and its successor, a
    new Worker under the same id, is left alone).
    """

    __slots__ = ("_columns", "probe", "released", "worker")

    # Made by `Fleet.attempt` only, which fills the slots itself (no `__init__` call a
    # try): `_columns` the table's, `released` False, one request counted in flight.
    _columns: FleetColumns
    probe: bool
    released: bool  # read by the proxy: a try its success released costs no second call
    worker: Worker

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        worker, columns = self.worker, self._columns
        worker.in_flight -= 1
        columns.publish(worker)
        if self.probe and worker.breaker.probing:
            worker.breaker.abandon_probe()
            columns.invalidate()

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Fleet:
    """The worker table. `workers` is for reading; change it through the methods."""

    # What the policy reads, `view(now, model=None, exclude=())`: the columns' own
    # `FleetColumns.view` (read only), set in __init__.
    view: Callable[..., FleetView]

    def __init__(
        self,
        config: RouterConfig,
        holdings: HoldingsHooks,
        remote_in_flight: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """`remote_in_flight`: other router replicas' requests in flight per worker
        (replica sync's `remote_inflight`); it returns the same mapping until one moves."""
        self.config = config
        self.holdings = holdings
        self.workers: dict[str, Worker] = {}
        self.columns = FleetColumns(self.workers, remote_in_flight)
        # What the policy reads: `FleetColumns.view` itself (read only), so a request's
        # view is one call, not a call through the table.
        self.view = self.columns.view

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
        self.columns.forget(worker)  # a request still in flight to it writes nowhere
        self.columns.invalidate()
        self.holdings.forget(worker_id)
        return True

    def apply_registry(
        self, records: dict[str, WorkerRecord], drop_missing: bool = True, now: float = 0.0
    ) -> tuple[list[str], list[str]]:
        """Bring registry-sourced workers in line with a full read of the registry, read
        at `now` (the policy ages a reported queue from then).

        Returns (joined or restarted, left). A changed epoch means the worker restarted
        with an empty cache, so its tree is dropped and its breaker closed; a changed
        model drops its tree too (its blocks were of the other model).
        """
        joined: list[str] = []
        for wid, record in records.items():
            worker = self.workers.get(wid)
            if worker is None:
                worker = self._new(wid, record.url, "redis")
                joined.append(wid)
            elif worker.report.epoch and worker.report.epoch != record.epoch:
                self.holdings.forget(wid)
                worker.breaker.record_success()  # a fresh process deserves a fresh chance
                self.columns.invalidate()
                joined.append(wid)
            self._report(worker, record, now)
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
        if model != worker.report.model:
            if worker.report.model:
                self.holdings.forget(worker.worker_id)
            worker.report = replace(worker.report, model=model)
            self.columns.invalidate()

    def _new(self, worker_id: str, url: str, source: Source) -> Worker:
        breaker = Breaker(self.config.breaker_failures, self.config.breaker_cooldown)
        blank = WorkerRecord(worker_id, url, model="", engine="", epoch=0.0)
        worker = Worker(worker_id, url, source, breaker, blank)
        self.workers[worker_id] = worker
        self.columns.invalidate()
        return worker

    def _report(self, w: Worker, r: WorkerRecord, now: float) -> None:
        old = w.report
        if old.model and r.model != old.model:
            self.holdings.forget(w.worker_id)
        w.report, w.reported_at, w.url = r, now, r.url
        if (r.model, r.adapters, r.draining, r.kv_capacity_tokens, r.host_kv_capacity_tokens) != (
            old.model,
            old.adapters,
            old.draining,
            old.kv_capacity_tokens,
            old.host_kv_capacity_tokens,
        ):
            self.columns.invalidate()  # a view's capacities column is replaced, not edited
        else:
            self.columns.report(w)  # the heartbeat and the load it moved, in place

    # -- the books: what the proxy asks ------------------------------------------------
    def attempt(self, worker: Worker, now: float) -> Attempt:
        """Start one try on `worker` (chosen from `view`); release it when it ends."""
        breaker = worker.breaker
        # Only an open breaker's cooldown ends in a probe: a closed one (the common
        # case) is not asked.
        probe = breaker.opened_at is not None and breaker.on_attempt(now)
        columns = self.columns
        if probe:
            columns.invalidate()  # a probing worker takes nothing else
        attempt = _new_attempt(Attempt)  # (the slots set here: a call less every try)
        attempt._columns, attempt.worker, attempt.probe, attempt.released = (
            columns, worker, probe, False,
        )  # fmt: skip
        worker.in_flight += 1
        worker.requests_total += 1
        columns.publish(worker)
        return attempt

    def succeeded(
        self, attempt: Attempt, predicted_tokens: float = 0.0, cached_tokens: int | None = None,
        chars: int = 0, prompt_tokens: float | None = None, now: float = 0.0,
        release: bool = False,
    ) -> None:  # fmt: skip
        """The worker answered; `cached_tokens` is what it reports having reused, against
        `predicted_tokens` (the room's prediction) when known; `prompt_tokens` its
        `usage.prompt_tokens` for a routing text of `chars` chars, where the router has no
        prompt ids (router/holdings/calibration.py). The room is told both.

        `release`: the try ends here too (a buffered answer, whole: the proxy's common
        exit), as `attempt.release()` right after would end it; one call, not two."""
        worker = attempt.worker
        breaker = worker.breaker
        if breaker.opened_at is not None or breaker.probing:
            self.columns.invalidate()
            breaker.record_success()
        elif breaker.failures:  # (a closed breaker with no failures has nothing to reset)
            breaker.record_success()
        if cached_tokens is not None:
            worker.predicted_tokens_total += predicted_tokens
            worker.actual_cached_tokens_total += cached_tokens
        # (no call where the answer teaches nothing: a router with prompt ids sends none)
        learned = (
            worker.chars_per_token
            if prompt_tokens is not None and calibrate(worker, chars, prompt_tokens)
            else None
        )
        if cached_tokens is not None or learned is not None:
            self.holdings.answered(worker.worker_id, predicted_tokens, cached_tokens, learned, now)
        if release and not attempt.released:
            # `Attempt.release`, written here. Its probe rule is moot: the success above
            # closed the breaker (`probing` False), as it would before a later release.
            attempt.released = True
            worker.in_flight -= 1
            self.columns.publish(worker)

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

    # -- reads (and `view`, set in __init__) ------------------------------------------
    def knows_model(self, model: str) -> bool:
        """Whether some worker serves `model`; True too while no worker reports a model."""
        columns = self.columns
        reported = (columns.names or columns.read_names())[0]
        return (
            not reported
            or model in reported
            or (not model and any(not w.report.model for w in self.workers.values()))
        )

    def serves_adapter(self, model: str | None) -> bool:
        """Whether some worker serves `model` as a LoRA adapter beside its base model (its
        requests then key their own cache namespace: router/holdings/namespace.py)."""
        if model is None:
            return False
        columns = self.columns
        return model in (columns.names or columns.read_names())[1]

    def models(self) -> dict[str, str | None]:
        """Every model served, sorted: a LoRA adapter with its base model (vLLM's
        `parent` in /v1/models), a base model with None."""
        parents: dict[str, str | None] = {}
        for w in self.workers.values():
            for adapter in w.report.adapters:
                parents.setdefault(adapter, w.report.model)
        return {m: parents.get(m) for m in sorted(self.columns.reported_models())}

    def in_flight_by_worker(self) -> dict[str, int]:
        """This router's requests in flight per worker (what replica sync shares)."""
        return {wid: w.in_flight for wid, w in self.workers.items()}
