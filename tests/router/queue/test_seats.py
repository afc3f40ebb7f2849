"""Seats shared by router replicas (router/queue/seats.py): however the replicas' takes
and the sync's stale counts interleave, a worker holds at most its seats plus
(replicas - 1) x the slack; without the growth bound it goes past that."""

from __future__ import annotations

import random

from router.fleet.table import Fleet
from router.queue.seats import Seats
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord


class Hooks:
    def remove_worker(self, worker_id: str) -> None:
        return


def _workers(seats: int) -> Fleet:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry(
        {
            "w": WorkerRecord(
                "w", "http://127.0.0.1:9000", "m", "sim", 1.0, max_running_requests=seats
            )
        }
    )
    return fleet


def _most_held(replicas: int, seats: int, bounded: bool, seed: int) -> int:
    """Replicas sharing one worker under a random schedule: each takes every seat it
    sees free and ends requests at random; each publishes its count every `interval`
    refreshes and reads the others' at its own phase (the sync's two stale steps)."""
    rng = random.Random(seed)
    fleet = _workers(seats)
    interval = 5  # refreshes per sync_load_interval (0.25 s / 50 ms)
    published = [0] * replicas
    seen = [dict[str, int]() for _ in range(replicas)]
    group = [
        Seats(fleet.workers, (lambda i=i: seen[i]) if bounded else None, 1.0, 10**6, 0.25, 15)
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
    for replicas, seats in ((2, 4), (3, 4), (2, 16)):
        slack = max(1, -(-seats // 4))  # ceil(seats x 0.25)
        bound = seats + (replicas - 1) * slack
        for seed in range(3):
            assert _most_held(replicas, seats, True, seed) <= bound, (replicas, seats, seed)
        assert max(_most_held(replicas, seats, False, seed) for seed in range(3)) > bound


def test_a_lone_router_fills_every_seat_at_once() -> None:
    seats = Seats(_workers(4).workers, None, 1.0, 100)
    for _ in range(4):
        assert seats.free("w")
        seats.take("w")
    assert not seats.free("w")
    assert "replica_ceiling" not in seats.describe("w")


def test_a_replica_grows_by_the_slack_per_window() -> None:
    seats = Seats(_workers(8).workers, lambda: {}, 1.0, 100, 0.25, 3)
    taken = []
    for _ in range(16):  # refreshes
        seats.refresh()
        n = 0
        while seats.free("w"):
            seats.take("w")
            n += 1
        taken.append(n)
    # 2 (a quarter of 8) above the least held over the window (3 refreshes): 2 at once,
    # 2 more once the window no longer remembers holding fewer.
    assert taken == [2, 0, 0, 0] * 4 and seats.held["w"] == 8
    # /workers shows the ceiling: the least held over the window (6, before the last
    # two were taken) + 2.
    assert seats.describe("w") == {
        "seats": 8,
        "seated": 8,
        "remote_in_flight": 0,
        "replica_ceiling": 8,
    }
