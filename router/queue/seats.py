"""A worker's seats: how many requests it may hold at once, and how many it holds.

    m(w)        = max_running_requests(w), from its heartbeat; a worker that reports
                  none (static, admin, not yet heard) has no bound: nothing ever waits
                  for it.
    seats(w)    = m(w) + queue_spare_seats (1): the engine's running slots, and one
                  request waiting in it, ready for the step after a slot frees (the
                  router's answer to a request's end, a dispatch, arrives a step late).
                  A fixed count, not a share of m: whatever waits in the engine is out
                  of the router's reach (its order, fairness, classes), and a share
                  would put 64 there at m = 256.
    occupied(w) = this router's seated requests on w (exact: counted from the moment a
                  seat is given, before the request leaves) + the other replicas'
                  requests in flight to w (replica sync, refreshed every
                  `sync_load_interval`).
    free(w)     = occupied(w) < seats(w), and this router holds under `max_concurrent`,
                  and (replicas only) held(w) < floor(w) + slack(w).

The worker's own running and waiting counts are not added: they are this router's
requests again, a heartbeat late, and a seat must come free the instant a request
ends.

Replicas (replica sync on: `remote` given). Another replica's figure is what it
published up to `sync_load_interval` ago, read up to one more interval ago, so two
replicas could each fill the same free seats. Each replica therefore grows its own
count on a worker by at most slack(w) = max(1, ceil(m(w) x queue_replica_slack))
above floor(w), the least it held there over the last `WINDOW_INTERVALS` sync
intervals: whatever the others read of it in that window is at least floor(w). The
bound this gives: with N replicas a worker holds at most seats(w) + (N - 1) x slack(w)
(the last replica to take a seat saw room under seats(w) with every other one's count,
and each of those counts has grown by at most slack(w) since it was published), as
long as what a replica reads of another is under `WINDOW_INTERVALS` intervals old (each
publishes and reads once an interval: a round later than that breaks the bound by what
is seated meanwhile; with Redis gone the replicas do not see each other at all). The
count published is the router's in flight, which trails a seat by the instant between
the seat and the send. The slack is a share of m, not of seats, so the spare seat does
not widen it: m + 1 + (N - 1) x max(1, ceil(m / 4)) with the defaults, 6 for m = 4 and
2 replicas (two waiting in a 4-slot engine), 321 for m = 256. The price: a replica
fills a worker from empty at slack(w) seats per window, not at once
(loadtests/results/fleet_queue.md measures both with 2 replicas).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping

from router.fleet.workers import Worker

NO_REMOTE: Mapping[str, int] = {}
# The window floor(w) covers, in sync intervals: one for the publish, one for the read,
# one for a round that runs late.
WINDOW_INTERVALS = 3


class Seats:
    def __init__(
        self,
        workers: Mapping[str, Worker],
        remote: Callable[[], Mapping[str, int]] | None,
        spare: int,
        max_concurrent: int,
        slack: float = 0.25,
        window_ticks: int = 15,
    ) -> None:
        """`slack` (`queue_replica_slack`) and `window_ticks` (refreshes per window) bound
        a replica's growth; they apply only with `remote` (replica sync on)."""
        self._workers = workers
        self._remote = remote or (lambda: NO_REMOTE)
        self.replicas = remote is not None
        self.spare = spare
        self.max_concurrent = max_concurrent
        self.held: dict[str, int] = {}  # this router's seated requests per worker
        self.total = 0
        self.slack = slack
        # floor(w): the least held on w in this refresh, and in each earlier one of the
        # window (oldest dropped); a worker in neither held none.
        self._low: dict[str, int] = {}
        self._lows: dict[str, deque[int]] = {}
        self._window_ticks = window_ticks
        self._floor: dict[str, int] = {}
        # Workers with no free seat, kept as seats are taken and given and re-read by
        # `refresh` (other replicas' counts, heartbeats): below saturation it is empty
        # and an arrival costs no pass over the fleet.
        self.full: set[str] = set()

    def running(self, worker_id: str) -> int:
        """m(w): the worker's running slots (0: it reports none)."""
        worker = self._workers.get(worker_id)
        return worker.report.max_running_requests if worker is not None else 0

    def seats(self, worker_id: str) -> int | None:
        """The worker's seats; None: unbounded (it reports no max_running_requests)."""
        most = self.running(worker_id)
        return most + self.spare if most > 0 else None

    def occupied(self, worker_id: str) -> int:
        return self.held.get(worker_id, 0) + self._remote().get(worker_id, 0)

    def free(self, worker_id: str) -> bool:
        if self.total >= self.max_concurrent:
            return False
        return self._room(worker_id)

    def _room(self, worker_id: str) -> bool:
        # `seats` and `occupied` inlined: this runs on every seat taken and given.
        workers = self._workers
        most = workers[worker_id].report.max_running_requests if worker_id in workers else 0
        if most <= 0:
            return True  # unbounded
        seats = most + self.spare
        held = self.held.get(worker_id, 0)
        if held + (self._remote().get(worker_id, 0) if self.replicas else 0) >= seats:
            return False
        return not self.replicas or held < self.ceiling(worker_id, most)

    def ceiling(self, worker_id: str, most: int) -> int:
        """floor(w) + slack(w): the most this replica may hold on w now (`most`: m(w))."""
        floor = min(self._floor.get(worker_id, 0), self._low.get(worker_id, 0))
        return floor + max(1, math.ceil(most * self.slack))

    def refresh(self) -> None:
        """Re-read every worker's seats (the queue's tick: replicas' counts, heartbeats),
        and move floor(w)'s window on by one refresh."""
        if self.replicas:
            self._slide()
        self.full = {wid for wid in self._workers if not self._room(wid)}

    def _slide(self) -> None:
        for wid in set(self._lows) | set(self._low) | set(self.held):
            lows = self._lows.get(wid)
            if lows is None:
                lows = self._lows[wid] = deque(maxlen=self._window_ticks)
            lows.append(self._low.get(wid, 0))
            floor = min(lows)
            if floor == 0 and not any(lows) and wid not in self.held:
                del self._lows[wid]  # nothing held on it for a whole window
                self._floor.pop(wid, None)
            else:
                self._floor[wid] = floor
        # Each new refresh starts at what is held now (absent: none, then or since).
        self._low = dict(self.held)

    # `take` and `give` end alike: `full` as the worker's room now is. Those lines are
    # written in both, not called: these two run on every request. Without replicas,
    # `_room` is `held < seats` and is written here too (a call less each).
    def take(self, worker_id: str) -> None:
        held = self.held
        now_held = held[worker_id] = held[worker_id] + 1 if worker_id in held else 1
        self.total += 1
        workers = self._workers
        most = workers[worker_id].report.max_running_requests if worker_id in workers else 0
        if most > 0 and (
            not self._room(worker_id) if self.replicas else now_held >= most + self.spare
        ):
            self.full.add(worker_id)
        elif self.full:  # (below saturation `full` is empty: no discard)
            self.full.discard(worker_id)

    def give(self, worker_id: str) -> None:
        held = self.held
        left = held[worker_id] - 1
        if left:
            held[worker_id] = left
        else:
            del held[worker_id]
        self.total -= 1
        workers = self._workers
        most = workers[worker_id].report.max_running_requests if worker_id in workers else 0
        if self.replicas:
            if left < self._low.get(worker_id, 0):
                self._low[worker_id] = left
            if most > 0 and not self._room(worker_id):
                self.full.add(worker_id)
                return
        elif most > 0 and left >= most + self.spare:
            self.full.add(worker_id)
            return
        if self.full:
            self.full.discard(worker_id)

    def describe(self, worker_id: str) -> dict[str, int | None]:
        """The seat figures /workers shows for a worker."""
        seats = self.seats(worker_id)
        out = {
            "seats": seats,
            "seated": self.held.get(worker_id, 0),
            "remote_in_flight": self._remote().get(worker_id, 0),
        }
        if self.replicas and seats is not None:
            out["replica_ceiling"] = self.ceiling(worker_id, self.running(worker_id))
        return out
