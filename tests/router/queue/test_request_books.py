"""A request's books in the fleet queue, fused for the handler (router/queue/fleet_queue.py
`arrive` and `served`, `Ticket.sit`'s first seat, `Seats.take`/`give` without `_room`):
the same figures as the steps they fuse (`ticket` + `pass_now`, `sit`, `answered` +
`done`), on a real worker table with an injected clock, whatever the way a request goes
(buffered, streamed, an error, a retry elsewhere, a missed objective, saturation)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from router.fleet.table import Fleet
from router.policy.base import RouteRequest
from router.queue.fleet_queue import FleetQueue
from router.queue.seats import Seats
from router.queue.ticket import Ticket
from shared.config import RouterConfig
from shared.serving.errors import APIError
from shared.wire.registry import WorkerRecord
from tests.waiting import ManualClock


class Hooks:
    def remove_worker(self, worker_id: str) -> None:
        return


def _queue(seats: dict[str, int], remote: dict[str, int] | None = None) -> FleetQueue:
    # (replicas: a slack of every seat, so each request here passes at once)
    cfg = RouterConfig.model_validate({"queue_spare_seats": 0, "queue_replica_slack": 1.0})
    fleet = Fleet(cfg, Hooks())  # type: ignore[arg-type]
    fleet.apply_registry(
        {
            wid: WorkerRecord(
                wid, f"http://127.0.0.1:{9000 + i}", "m", "sim", 1.0, max_running_requests=n
            )
            for i, (wid, n) in enumerate(seats.items())
        }
    )
    others = None if remote is None else (lambda: remote)
    return FleetQueue(cfg, fleet, lambda r: {}, others, ManualClock())


def _books(queue: FleetQueue) -> dict[str, Any]:
    """Every figure a request's books write."""
    return {
        "snapshot": queue.stats.snapshot(),
        "waits": {k: list(t.waits) for k, t in queue.stats.tallies.items()},
        "held": dict(queue.seats.held),
        "total": queue.seats.total,
        "full": set(queue.seats.full),
        "prefill": {
            (wid, tenant.name): [t.request.text for t in on]
            for (wid, tenant), on in queue.prefilling.on.items()
        },
        "active": queue.active,
    }


# One request's way, as the handler and the proxy go (`fused`) or step by step: `sit` the
# workers tried in turn, `head` the status of a stream's head told first (or None),
# `status` the answer's, `late` the seconds it took.
Way = tuple[list[str], int | None, int, float]


def _step_by_step(queue: FleetQueue, text: str, way: Way) -> Ticket:
    ticket = queue.ticket(queue.tenants.default, "standard", RouteRequest(text, model="m"))
    assert queue.pass_now(ticket)
    return ticket


def _arrive(queue: FleetQueue, text: str, way: Way) -> Ticket:
    ticket = queue.arrive(queue.tenants.default, "standard", RouteRequest(text, model="m"))
    assert ticket.seated == ticket.arrived
    return ticket


def _run(queue: FleetQueue, ways: list[Way], fused: bool) -> list[dict[str, Any]]:
    """The requests all sit first (so several share a worker), then end in `ENDS` order
    (some the last seated on their worker, some not); the books after each step."""
    clock: ManualClock = queue.clock  # type: ignore[assignment]
    seen = []
    tickets = []
    for i, way in enumerate(ways):
        ticket = (_arrive if fused else _step_by_step)(queue, f"r{i}", way)
        for wid in way[0]:
            ticket.sit(wid) if fused else queue.sit(ticket, wid)
        tickets.append(ticket)
        seen.append(_books(queue))
    for i in ENDS:
        ticket, (_, head, status, late) = tickets[i], ways[i]
        clock.advance(late)
        if head is not None:  # a stream's head left first (the app's hook)
            queue.answered(ticket, head)
        if fused:
            queue.served(ticket, status)
        else:
            queue.answered(ticket, status)
            queue.done(ticket)
        queue.answered(ticket, status)  # the head hook after a buffered answer
        seen.append(_books(queue))
    return seen


WAYS: list[Way] = [
    (["w0"], None, 200, 0.01),  # buffered, in time
    (["w0"], 200, 200, 0.02),  # a stream: its head told first
    (["w0", "w1"], None, 200, 0.0),  # a retry on another worker
    (["w1"], None, 500, 0.0),  # an error answer
    (["w0"], None, 200, 30.0),  # past its class's objective
    (["w1"], 200, 200, 30.0),  # a stream whose head was late
    (["w0"], 404, 404, 0.0),  # a stream refused at its head
]
ENDS = [0, 3, 6, 1, 5, 2, 4]


@pytest.mark.parametrize("remote", [None, {"w0": 1}])
def test_the_handlers_fused_books_write_what_the_steps_write(
    remote: dict[str, int] | None,
) -> None:
    seats = {"w0": 8, "w1": 8}
    step = _run(_queue(seats, remote), WAYS, fused=False)
    fused = _run(_queue(seats, remote), WAYS, fused=True)
    assert fused == step
    assert step[-1]["snapshot"]["default"]["standard"]["served"] == 5  # (the test's own check)


def test_arrive_waits_and_refuses_as_pass_now_does() -> None:
    """Saturated (a full worker: the rest excluded), all full (waits), draining (503)."""
    for fused in (False, True):
        queue = _queue({"w0": 1, "w1": 1})
        arrive = _arrive_or_pass(queue, fused)
        first = arrive()
        first.sit("w0")
        second = arrive()  # w0 full: passes, kept off w0
        assert second.seated is not None and list(second.exclude) == ["w0"]
        second.sit("w1")
        third = arrive()  # every seat taken: it must wait
        assert third.seated is None and queue.active == 2
        queue.draining = True
        with pytest.raises(APIError) as refused:
            arrive()
        assert refused.value.status == 503 and refused.value.code == "draining"


def _arrive_or_pass(queue: FleetQueue, fused: bool) -> Callable[[], Ticket]:
    tenant, request = queue.tenants.default, RouteRequest("x", model="m")

    def arrive() -> Ticket:
        if fused:
            return queue.arrive(tenant, "standard", request)
        ticket = queue.ticket(tenant, "standard", request)
        queue.pass_now(ticket)
        return ticket

    return arrive


def _room_of(seats: Seats) -> Callable[[str], bool]:
    return seats._room


@pytest.mark.parametrize("replicas", [False, True])
def test_take_and_give_keep_full_as_the_room_rule_says(replicas: bool) -> None:
    """`take` and `give` write `_room`'s rule themselves: after any sequence of them,
    `full` is exactly the workers `_room` says have none (a bounded worker, an unbounded
    one, another replica's requests)."""
    fleet = Fleet(RouterConfig(), Hooks())  # type: ignore[arg-type]
    fleet.apply_registry(
        {
            "a": WorkerRecord(
                "a", "http://127.0.0.1:9000", "m", "sim", 1.0, max_running_requests=3
            ),
            "b": WorkerRecord(
                "b", "http://127.0.0.1:9001", "m", "sim", 1.0, max_running_requests=0
            ),
        }
    )
    remote = {"a": 1}
    seats = Seats(fleet.workers, (lambda: remote) if replicas else None, 1, 10**6, 0.25, 15)
    rng = random.Random(7)
    room = _room_of(seats)
    for _ in range(400):
        wid = rng.choice("ab")
        if seats.held.get(wid) and rng.random() < 0.45:
            seats.give(wid)
        else:
            seats.take(wid)
        if rng.random() < 0.1:
            seats.refresh()
        assert seats.full == {w for w in "ab" if not room(w)}
    assert seats.held  # (the sequence did hold seats)
