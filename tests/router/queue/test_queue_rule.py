"""The fleet queue's rule (router/queue/fleet_queue.py), step by step, on a real worker
table with an injected clock and affinity: who gets each freed seat."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from router.fleet.table import Fleet
from router.policy.base import RouteRequest
from router.queue.fleet_queue import FleetQueue
from router.queue.ticket import InPrefill, Ticket
from shared.config import ConfigError, RouterConfig, load_config
from shared.serving.errors import APIError
from shared.wire.registry import WorkerRecord
from tests.waiting import ManualClock


class Hooks:
    def remove_worker(self, worker_id: str) -> None:
        return


def _queue(
    seats: dict[str, int], affinity: dict[str, Mapping[str, float]] | None = None,
    remote: dict[str, int] | None = None, **config: Any,
) -> tuple[FleetQueue, ManualClock]:  # fmt: skip
    # Seats as given (no spare seat, unless a test asks for one).
    cfg = RouterConfig.model_validate({"queue_spare_seats": 0, **config})
    fleet = Fleet(cfg, Hooks())
    records = {
        wid: WorkerRecord(
            wid, f"http://127.0.0.1:{9000 + i}", "m", "sim", 1.0, max_running_requests=n
        )
        for i, (wid, n) in enumerate(seats.items())
    }
    fleet.apply_registry(records)
    clock = ManualClock()
    predict = affinity or {}
    others = None if remote is None else (lambda: remote)
    queue = FleetQueue(cfg, fleet, lambda r: predict.get(r.text, {}), others, clock)
    return queue, clock


def _ticket(
    queue: FleetQueue, text: str, tenant: str = "default", klass: str = "standard"
) -> Ticket:
    return queue.ticket(queue.tenants.by_name[tenant], klass, RouteRequest(text, model="m"))  # type: ignore[arg-type]


async def _enter(queue: FleetQueue, ticket: Ticket) -> asyncio.Task:
    task = asyncio.create_task(queue.admit(ticket))
    await asyncio.sleep(0)  # it runs up to its wait (or through, when it passes)
    return task


async def _fill(queue: FleetQueue, n: int) -> list[Ticket]:
    """n requests that pass at once and sit on the fleet's seats, as the proxy seats them."""
    out = []
    for i in range(n):
        ticket = _ticket(queue, f"filler{i}")
        await queue.admit(ticket)
        wid = next(w for w in queue.fleet.workers if w not in ticket.exclude)
        queue.sit(ticket, wid)
        out.append(ticket)
    return out


async def _served_order(queue: FleetQueue, runner: Ticket, waiting: list[Ticket]) -> list[str]:
    """Free the seat one request at a time and note who takes it."""
    order = []
    for _ in waiting:
        queue.done(runner)
        await asyncio.sleep(0)
        runner = next(t for t in waiting if t.worker is not None and t.request.text not in order)
        order.append(runner.request.text)
    return order


async def test_drr_serves_tenants_in_proportion_to_weight() -> None:
    tenants = {"big": {"keys": ["kb"], "weight": 3}, "small": {"keys": ["ks"]}}
    queue, _ = _queue({"w0": 1}, tenants=tenants, queue_quantum=1)
    [runner] = await _fill(queue, 1)
    waiting = [_ticket(queue, f"big{i}", "big") for i in range(8)]
    waiting += [_ticket(queue, f"small{i}", "small") for i in range(8)]
    tasks = [await _enter(queue, t) for t in waiting]
    order = await _served_order(queue, runner, waiting)
    firsts = order[:8]
    assert sum(name.startswith("big") for name in firsts) == 6, order  # 3:1
    for task in tasks:
        task.cancel()


async def test_affinity_picks_the_request_that_hits_and_holds_for_its_worker() -> None:
    affinity = {"hit-w0": {"w0": 100.0}, "hit-w1": {"w1": 100.0}, "cold": {}}
    queue, _ = _queue({"w0": 1, "w1": 1}, affinity)
    w0, w1 = await _fill(queue, 2)
    assert {w0.worker, w1.worker} == {"w0", "w1"}
    if w0.worker != "w0":
        w0, w1 = w1, w0
    tickets = [_ticket(queue, name) for name in ("hit-w1", "cold", "hit-w0")]
    for t in tickets:
        await _enter(queue, t)
    queue.done(w0)  # w0 frees: the request that hits on it, though it arrived last
    assert tickets[2].worker == "w0"
    queue.done(tickets[2])  # again w0: "hit-w1" is held for w1 while "cold" can use it
    assert tickets[1].worker == "w0" and tickets[0].worker is None
    queue.done(tickets[1])  # only the held one is left: w0 does not stay empty for it
    assert tickets[0].worker == "w0"
    # Held, even an interactive request lets a batch one have w0 while it waits for w1.
    held = _ticket(queue, "hit-w1", klass="interactive")
    cold = _ticket(queue, "cold", klass="batch")
    await _enter(queue, held)
    await _enter(queue, cold)
    queue.done(tickets[0])
    assert cold.worker == "w0" and held.worker is None


async def test_an_urgent_request_takes_a_worse_worker_but_not_a_higher_class() -> None:
    affinity = {"hit-w1": {"w1": 100.0}, "cold": {}}
    queue, clock = _queue({"w0": 1, "w1": 1}, affinity)
    fillers = await _fill(queue, 2)
    on_w0 = next(t for t in fillers if t.worker == "w0")
    # SLO 120 s: urgent after 60 s (first on w1, still held from w0), critical after 90 s
    urgent = _ticket(queue, "hit-w1", klass="batch")
    await _enter(queue, urgent)
    clock.advance(61)
    early = _ticket(queue, "cold", klass="batch")
    await _enter(queue, early)
    queue.done(on_w0)  # urgent, not critical: w0's seat goes to the cold one
    assert early.worker == "w0" and urgent.worker is None
    on_w0 = early
    clock.advance(30)
    fresh = _ticket(queue, "cold", klass="batch")
    interactive = _ticket(queue, "cold", klass="interactive")  # SLO 1 s, just in
    await _enter(queue, fresh)
    await _enter(queue, interactive)
    queue.done(on_w0)  # the interactive class first, urgent or not
    assert interactive.worker == "w0" and urgent.worker is None
    queue.done(interactive)  # then the urgent batch one, on w0 though it hits on w1
    assert urgent.worker == "w0" and fresh.worker is None


async def test_a_request_takes_its_best_workers_seat_when_both_come_free() -> None:
    # Another replica held both seats; they come free in one pass. The emptier-first
    # order would put w0 first: the requests that hit on w1 take w1's seat instead,
    # urgent or not (the rule's 0a), and a cold one takes w0's.
    affinity = {"hit-w1": {"w1": 100.0}, "near-w1": {"w0": 60.0, "w1": 100.0}, "cold": {}}
    for text, wait in (("hit-w1", 91.0), ("near-w1", 0.0)):
        remote = {"w0": 1, "w1": 1}
        queue, clock = _queue({"w0": 1, "w1": 1}, affinity, remote)
        queue.seats.refresh()  # the replica's counts read: both workers full
        ticket = _ticket(queue, text, klass="batch")  # critical after 90 s
        await _enter(queue, ticket)
        clock.advance(wait)
        remote.clear()
        queue.seats.refresh()
        queue.pump()
        assert ticket.worker == "w1", text
        assert queue.stats.placed["best"] == 1


async def test_a_turn_waits_while_the_turn_it_extends_is_before_its_first_byte() -> None:
    tenants = {"a": {"keys": ["ka"]}, "b": {"keys": ["kb"]}}
    turn2 = "chat: hello. answer. and then?"
    affinity = {turn2: {"w0": 100.0}}  # the tree learnt turn 1 went to w0
    queue, _ = _queue({"w0": 2}, affinity, tenants=tenants)
    turn1 = _ticket(queue, "chat: hello.", "a")
    await queue.admit(turn1)
    queue.sit(turn1, "w0")
    [filler] = await _fill(queue, 1)
    nxt, cold = _ticket(queue, turn2, "a"), _ticket(queue, "cold", "a")
    await _enter(queue, nxt)
    await _enter(queue, cold)
    queue.done(filler)  # turn 1 is still in prefill: the cold one takes the seat
    assert cold.worker == "w0" and nxt.worker is None
    queue.answered(turn1, 200)  # turn 1's prompt is in w0's cache now
    queue.done(cold)
    assert nxt.worker == "w0"
    assert queue.stats.placed == {"best": 2, "urgent": 0, "held": 0, "near": 0}
    # Another tenant's prompt is no turn of this one's conversation: not held for it.
    other = _ticket(queue, turn2 + " more", "b")
    later = _ticket(queue, "cold too", "b")
    await _enter(queue, other)
    await _enter(queue, later)
    queue.done(turn1)  # `nxt` is in prefill on w0, but it is tenant a's
    assert other.worker == "w0" and later.worker is None


def test_a_ticket_leaves_prefill_wherever_it_stands_on_its_worker() -> None:
    queue, _ = _queue({"w0": 4})
    tickets = [_ticket(queue, f"t{i}") for i in range(3)]
    tenant = queue.tenants.default
    on = InPrefill()
    for ticket in tickets:
        ticket.worker = "w0"
        on.add(ticket, "w0")
    on.remove(tickets[0])  # not the one added last
    assert on.of("w0", tenant) == tickets[1:]
    on.remove(tickets[2])  # the one added last
    assert on.of("w0", tenant) == [tickets[1]]
    on.remove(tickets[2])  # gone already: nothing to do
    on.remove(tickets[1])
    assert on.of("w0", tenant) is None
    on.remove(tickets[1])  # its worker's list gone too: nothing to do


async def test_drain_waits_for_the_admitted_and_the_waiting() -> None:
    idle, _ = _queue({"w0": 1})
    assert await idle.drain(5.0)  # nothing admitted: drained at once
    queue, _ = _queue({"w0": 1})
    [runner] = await _fill(queue, 1)
    waiting = _ticket(queue, "next")
    task = await _enter(queue, waiting)
    drain = asyncio.create_task(queue.drain(30.0))
    await asyncio.sleep(0)
    with pytest.raises(APIError) as refused:  # no new request while draining
        await queue.admit(_ticket(queue, "late"))
    assert refused.value.status == 503
    queue.done(runner)  # its seat goes to the one waiting, which still has to end
    await task
    await asyncio.sleep(0)
    assert waiting.worker == "w0" and not drain.done()
    queue.done(waiting)
    assert await drain
    stuck, _ = _queue({"w0": 1})
    await _fill(stuck, 1)
    assert not await stuck.drain(0.01)  # one never ends: the timeout says so


async def test_the_bounds_refuse_only_their_tenant() -> None:
    tenants = {"a": {"keys": ["ka"], "max_queue": 1}}
    queue, _ = _queue({"w0": 1}, tenants=tenants)
    await _fill(queue, 1)
    await _enter(queue, _ticket(queue, "a0", "a"))
    with pytest.raises(APIError) as refused:
        await queue.admit(_ticket(queue, "a1", "a"))
    assert refused.value.status == 429 and "max_queue bound (1 requests" in refused.value.message
    other = _ticket(queue, "d0")
    await _enter(queue, other)  # the default tenant still queues
    assert queue.waiting == 2 and other in queue.tenants.default.queues[1]


def test_config_refuses_a_shared_key_and_a_bad_weight() -> None:
    both = {"a": {"keys": ["k1"]}, "b": {"keys": ["k2", "k1"]}}
    with pytest.raises(ConfigError, match=r"tenants\.b\.keys\[1\] is also a key of tenant 'a'"):
        load_config(RouterConfig, overrides={"tenants": both}, environ={})
    for weight in (0, -1):
        with pytest.raises(ConfigError, match=r"tenants\.a\.weight: .*greater than 0"):
            load_config(
                RouterConfig, overrides={"tenants": {"a": {"keys": ["k"], "weight": weight}}},
                environ={},
            )  # fmt: skip
    with pytest.raises(ConfigError, match=r"classes\.interactive\.ttft_slo_s"):
        load_config(
            RouterConfig, overrides={"classes": {"interactive": {"ttft_slo_s": 0}}}, environ={}
        )


def test_a_config_file_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "policy: cache_aware\n"
        "tenants:\n"
        "  a: {keys: [k1]}\n"
        "  b:\n"
        "    keys:\n"
        "      - k2\n"
        "      - k1\n"
        "    weight: 1\n"
    )
    with pytest.raises(ConfigError, match=r"keys\[1\] is also a key of tenant 'a'.*line 7\)"):
        load_config(RouterConfig, path, environ={})
    path.write_text("tenants:\n  a:\n    keys: [k]\n    weight: 0\n")
    with pytest.raises(ConfigError, match=r"tenants\.a\.weight: .*greater than 0.*line 4\)"):
        load_config(RouterConfig, path, environ={})


def test_config_bounds_a_weight_and_the_quantum_to_finite_credit() -> None:
    """A weight (or quantum) of 1e-320 made the new-round count, credit / (weight x
    quantum), infinite: `math.floor` raised OverflowError on every freed seat, so the
    queue never handed seats again. An infinite weight starved every other tenant. The
    config refuses both, naming the key."""
    for weight in (1e-320, 1e-7, float("inf"), float("nan"), 1e7):
        with pytest.raises(ConfigError, match=r"tenants\.a\.weight"):
            load_config(
                RouterConfig, overrides={"tenants": {"a": {"keys": ["k"], "weight": weight}}},
                environ={},
            )  # fmt: skip
    for quantum in (1e-320, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"queue_quantum"):
            load_config(RouterConfig, overrides={"queue_quantum": quantum}, environ={})
    # A wait bound of infinity raised OverflowError computing the 429's Retry-After (a
    # quarter of it, whole seconds): the client got a 500; 1e300 a 301-digit header.
    for wait in (float("inf"), 1e300):
        with pytest.raises(ConfigError, match=r"queue_timeout"):
            load_config(RouterConfig, overrides={"queue_timeout": wait}, environ={})
        with pytest.raises(ConfigError, match=r"tenants\.a\.max_queue_wait_s"):
            load_config(
                RouterConfig, environ={},
                overrides={"tenants": {"a": {"keys": ["k"], "max_queue_wait_s": wait}}},
            )  # fmt: skip


async def test_a_refusal_at_the_longest_wait_allowed_is_a_429_with_a_short_header() -> None:
    from shared.config import MAX_QUEUE_WAIT_S

    queue, _ = _queue({"w0": 1}, max_queue=1, queue_timeout=MAX_QUEUE_WAIT_S)
    await _fill(queue, 1)
    waiting = await _enter(queue, _ticket(queue, "a"))
    with pytest.raises(APIError) as refused:
        await queue.admit(_ticket(queue, "b"))
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == str(int(MAX_QUEUE_WAIT_S / 4))
    waiting.cancel()


async def test_the_extreme_weights_the_config_allows_still_hand_every_seat() -> None:
    """At the bounds (MIN_WEIGHT beside MAX_WEIGHT, MIN_QUANTUM) the credit arithmetic
    stays finite: every waiting request gets the seat in turn, the heavy tenant ahead."""
    from shared.config import MAX_WEIGHT, MIN_QUANTUM, MIN_WEIGHT

    tenants = {"tiny": {"keys": ["kt"], "weight": MIN_WEIGHT},
               "huge": {"keys": ["kh"], "weight": MAX_WEIGHT}}  # fmt: skip
    queue, _ = _queue({"w0": 1}, tenants=tenants, queue_quantum=MIN_QUANTUM)
    [runner] = await _fill(queue, 1)
    waiting = [_ticket(queue, f"tiny{i}", "tiny") for i in range(3)]
    waiting += [_ticket(queue, f"huge{i}", "huge") for i in range(3)]
    tasks = [await _enter(queue, t) for t in waiting]
    order = await _served_order(queue, runner, waiting)
    assert sorted(order) == sorted(t.request.text for t in waiting), order
    # (tiny0 may go first: a tenant that starts waiting starts with its quantum of credit)
    assert order.index("huge2") < order.index("tiny1"), order
    for task in tasks:
        task.cancel()


@pytest.mark.parametrize(
    "weight, quantum",
    [(1e-320, 1.0), (float("inf"), 1.0), (float("nan"), 1.0), (1.0, 1e-320), (1e300, 1e300)],
)
async def test_credit_past_the_configs_bounds_still_hands_every_seat(
    weight: float, quantum: float
) -> None:
    """The queue's own guard, should the config's bounds on weight and queue_quantum be
    widened: values the schema refuses, set directly. A weight or quantum of 1e-320 made
    the new-round count infinite (OverflowError on every freed seat: those two cases
    fail without the guard); with it, and with infinite or NaN credit, each seat still
    goes to a waiting request."""
    tenants = {"odd": {"keys": ["ko"]}, "plain": {"keys": ["kp"]}}
    queue, _ = _queue({"w0": 1}, tenants=tenants)
    queue.tenants.by_name["odd"].weight = weight
    queue.config = queue.config.model_copy(update={"queue_quantum": quantum})  # unchecked
    [runner] = await _fill(queue, 1)
    waiting = [_ticket(queue, f"odd{i}", "odd") for i in range(3)]
    waiting += [_ticket(queue, f"plain{i}", "plain") for i in range(3)]
    tasks = [await _enter(queue, t) for t in waiting]
    order = await _served_order(queue, runner, waiting)
    assert sorted(order) == sorted(t.request.text for t in waiting), order
    for task in tasks:
        task.cancel()


@pytest.mark.parametrize("wait", [float("inf"), float("nan"), 1e300])
async def test_a_refusal_past_the_configs_wait_bound_is_still_a_429(wait: float) -> None:
    """Retry-After is a quarter of the wait bound: an infinite bound raised OverflowError
    (the client got a 500), NaN ValueError, 1e300 sent a 301-digit header. The queue
    caps it at a day whatever the bound (set directly: the schema refuses these)."""
    queue, _ = _queue({"w0": 1}, max_queue=1)
    await _fill(queue, 1)
    waiting = await _enter(queue, _ticket(queue, "a"))
    queue.tenants.default.max_wait_s = wait
    with pytest.raises(APIError) as refused:
        await queue.admit(_ticket(queue, "b"))
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == "86400"
    waiting.cancel()
