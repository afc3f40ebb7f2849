"""Seats shared by router replicas (router/queue/seats.py): however the replicas' takes
and the sync's stale counts interleave, a worker holds at most its seats
(max_running_requests m + the spare seats) plus (replicas - 1) x the slack (a share of
m, not of seats); without the growth bound it goes past that."""

from __future__ import annotations

import random

from router.fleet.table import Fleet
from router.queue.seats import Seats
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord


class Hooks:
    def remove_worker(self, worker_id: str) -> None:
        return


def _workers(running: int) -> Fleet:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry(
        {
            "w": WorkerRecord(
                "w", "http://127.0.0.1:9000", "m", "sim", 1.0, max_running_requests=running
            )
        }
    )
    return fleet


def _most_held(replicas: int, running: int, spare: int, bounded: bool, seed: int) -> int:
    """Replicas sharing one worker under a random schedule: each takes every seat it
    sees free and ends requests at random; each publishes its count every `interval`
    refreshes and reads the others' at its own phase (the sync's two stale steps)."""
    rng = random.Random(seed)
    fleet = _workers(running)
    interval = 5  # refreshes per sync_load_interval (0.25 s / 50 ms)
    published = [0] * replicas
    seen = [dict[str, int]() for _ in range(replicas)]
    group = [
        Seats(fleet.workers, (lambda i=i: seen[i]) if bounded else None, spare, 10**6, 0.25, 15)
        for i in range(replicas)
    ]
    if not bounded:  # the counts still shared, but no growth bound
        for i, s in enumerate(group):
            s._remote = lambda i=i: seen[i]
    most = 0
    for tick in range(3000):
        for i, s in enumerate(group):
            if tick % interval == 0:
                published[i] = s.held.get("w", 0)
            if tick % interval == (i + 2) % interval:  # reads at its own phase
                seen[i] = {"w": sum(published[j] for j in range(replicas) if j != i)}
            s.refresh()
            while rng.random() < 0.7 and s.free("w"):
                s.take("w")
            for _ in range(s.held.get("w", 0)):
                if rng.random() < 0.3:
                    s.give("w")
        most = max(most, sum(s.held.get("w", 0) for s in group))
    return most


def test_replicas_hold_a_worker_within_the_stated_bound() -> None:
    # (replicas, m, spare seats): the default spare (1), and none.
    for replicas, running, spare in ((2, 4, 1), (3, 4, 1), (2, 4, 0), (2, 16, 1), (2, 16, 0)):
        slack = max(1, -(-running // 4))  # ceil(m x 0.25): of m, not of m + spare
        bound = running + spare + (replicas - 1) * slack
        case = (replicas, running, spare)
        for seed in range(3):
            assert _most_held(replicas, running, spare, True, seed) <= bound, (case, seed)
        unbounded = (_most_held(replicas, running, spare, False, seed) for seed in range(3))
        assert max(unbounded) > bound, case


def test_a_lone_router_fills_every_seat_at_once() -> None:
    seats = Seats(_workers(4).workers, None, 1, 100)
    for _ in range(5):  # 4 running slots + 1 spare seat
        assert seats.free("w")
        seats.take("w")
    assert not seats.free("w")
    assert "replica_ceiling" not in seats.describe("w")


def test_a_replica_grows_by_the_slack_per_window() -> None:
    seats = Seats(_workers(8).workers, lambda: {}, 1, 100, 0.25, 3)
    taken = []
    for _ in range(20):  # refreshes
        seats.refresh()
        n = 0
        while seats.free("w"):
            seats.take("w")
            n += 1
        taken.append(n)
    # 2 (a quarter of m = 8, not of its 9 seats) above the least held over the window
    # (3 refreshes): 2 at once, 2 more once the window no longer remembers holding
    # fewer, and the last seat (the spare) alone.
    assert taken == [2, 0, 0, 0] * 4 + [1, 0, 0, 0] and seats.held["w"] == 9
    # /workers shows the ceiling: the least held over the window (8, before the last
    # one was taken) + 2.
    assert seats.describe("w") == {
        "seats": 9,
        "seated": 9,
        "remote_in_flight": 0,
        "replica_ceiling": 10,
    }
