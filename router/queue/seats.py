"""A worker's seats: how many requests it may hold at once, and how many it holds.

    seats(w)    = ceil(max_running_requests(w) x queue_seat_factor), from its heartbeat;
                  a worker that reports none (static, admin, not yet heard) has no
                  bound: nothing ever waits for it.
    occupied(w) = this router's seated requests on w (exact: counted from the moment a
                  seat is given, before the request leaves) + the other replicas'
                  requests in flight to w (replica sync, refreshed every
                  `sync_load_interval`).
    free(w)     = occupied(w) < seats(w), and this router holds under `max_concurrent`.

The worker's own running and waiting counts are not added: they are this router's
requests again, a heartbeat late, and a seat must come free the instant a request
ends. Another replica's figure is up to one `sync_load_interval` old, so replicas may
together seat a worker past its seats by what they give it within one interval
(loadtests/results/fleet_queue.md measures it with 2 replicas).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from router.fleet.workers import Worker

NO_REMOTE: Mapping[str, int] = {}


class Seats:
    def __init__(
        self,
        workers: Mapping[str, Worker],
        remote: Callable[[], Mapping[str, int]] | None,
        factor: float,
        max_concurrent: int,
    ) -> None:
        self._workers = workers
        self._remote = remote or (lambda: NO_REMOTE)
        self.factor = factor
        self.max_concurrent = max_concurrent
        self.held: dict[str, int] = {}  # this router's seated requests per worker
        self.total = 0
        # Workers with no free seat, kept as seats are taken and given and re-read by
        # `refresh` (other replicas' counts, heartbeats): below saturation it is empty
        # and an arrival costs no pass over the fleet.
        self.full: set[str] = set()

    def seats(self, worker_id: str) -> int | None:
        """The worker's seats; None: unbounded (it reports no max_running_requests)."""
        worker = self._workers.get(worker_id)
        most = worker.report.max_running_requests if worker is not None else 0
        return math.ceil(most * self.factor) if most > 0 else None

    def occupied(self, worker_id: str) -> int:
        return self.held.get(worker_id, 0) + self._remote().get(worker_id, 0)

    def free(self, worker_id: str) -> bool:
        if self.total >= self.max_concurrent:
            return False
        return self._room(worker_id)

    def _room(self, worker_id: str) -> bool:
        seats = self.seats(worker_id)
        return seats is None or self.occupied(worker_id) < seats

    def _note(self, worker_id: str) -> None:
        if self._room(worker_id):
            self.full.discard(worker_id)
        else:
            self.full.add(worker_id)

    def refresh(self) -> None:
        """Re-read every worker's seats (the queue's tick: replicas' counts, heartbeats)."""
        self.full = {wid for wid in self._workers if not self._room(wid)}

    def take(self, worker_id: str) -> None:
        self.held[worker_id] = self.held.get(worker_id, 0) + 1
        self.total += 1
        self._note(worker_id)

    def give(self, worker_id: str) -> None:
        left = self.held[worker_id] - 1
        if left:
            self.held[worker_id] = left
        else:
            del self.held[worker_id]
        self.total -= 1
        self._note(worker_id)

    def describe(self, worker_id: str) -> dict[str, int | None]:
        """The seat figures /workers shows for a worker."""
        return {
            "seats": self.seats(worker_id),
            "seated": self.held.get(worker_id, 0),
            "remote_in_flight": self._remote().get(worker_id, 0),
        }
