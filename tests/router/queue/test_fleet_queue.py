"""The fleet queue (router/queue/) against a real router and sim workers (the real engine
with a cost model) that heartbeat into a real Redis-protocol server started here.

Each worker runs one request at a time (`max_running_requests=1`: one seat), so which
request is served when is decided by the router's queue alone and the tests read it
as an order, never as a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from router.http.state import FLEET, QUEUE
from router.queue.fleet_queue import FleetQueue
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.registry import Registry, WorkerRecord
from tests.router.conftest import StartRouter, StartWorkers, url_of
from tests.waiting import wait_until
from tests.worker.conftest import WorkerThread, sim_config

# 40 tokens at 5 ms each: a request holds its seat ~0.2 s; the first of a test holds
# it ~2 s, while the test queues the rest behind it (they queue in any case: they
# only wait less when it ends early).
SLOW = {"prompt": "hello there", "max_tokens": 40, "ignore_eos": True}
BLOCK = {**SLOW, "max_tokens": 400}
FAST = {"prompt": "hi", "max_tokens": 1}
TENANTS = {
    "a": {"keys": ["key-a"], "max_queue": 2, "max_queue_wait_s": 30},
    "b": {"keys": ["key-b"], "max_queue_wait_s": 0.3},
    "c": {"keys": ["key-c"]},
}


@pytest.fixture
def sim_workers(redis_server: RedisServer) -> Iterator[Callable[[int], list[WorkerThread]]]:
    started: list[WorkerThread] = []

    def start(n: int) -> list[WorkerThread]:
        for i in range(n):
            config = sim_config(
                redis_url=redis_server.url, heartbeat_interval=0.1, worker_id=f"q{i}",
                max_running_requests=1, sim_decode_ms_per_token=5.0,
            )  # fmt: skip
            started.append(WorkerThread(config).start())
        return started

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
async def fleet(
    sim_workers: Callable[[int], list[WorkerThread]],
    start_router: StartRouter,
    redis_server: RedisServer,
) -> AsyncIterator[Callable[..., Any]]:
    async def start(n: int = 1, **overrides: Any) -> tuple[Any, FleetQueue]:
        sim_workers(n)
        # No spare seat unless asked (the default's one would let a second request wait
        # in the engine, out of the queue's order): one seat a worker.
        settings = {
            "redis_url": redis_server.url, "discovery_interval": 0.1, "tenants": TENANTS,
            "queue_spare_seats": 0,
        }  # fmt: skip
        settings.update(overrides)
        client = await start_router(**settings)
        queue = client.server.app[QUEUE]
        # Seats come from the heartbeats: 1 + the spare each once the router has read them.
        each = 1 + settings["queue_spare_seats"]
        await wait_until(lambda: [queue.seats.seats(f"q{i}") for i in range(n)] == [each] * n, 10)
        return client, queue

    yield start


def _key(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}"}


async def _post(client: Any, body: dict, tenant: str = "c", **fields: Any) -> tuple[int, dict]:
    r = await client.post("/v1/completions", json={**body, **fields}, headers=_key(tenant))
    return r.status, await r.json()


async def test_below_saturation_nothing_waits(fleet: Callable[..., Any]) -> None:
    client, queue = await fleet(2)
    # Two at once on two seats, then one after the other: each passes on arrival.
    results = await asyncio.gather(_post(client, SLOW), _post(client, SLOW))
    results.append(await _post(client, FAST))
    assert [status for status, _ in results] == [200, 200, 200]
    tally = queue.stats.tallies["c", "standard"]
    assert tally.served == 3 and tally.wait_s == 0.0  # not one waited in the router
    # A third at once on two seats waits: the queue is not a pass-through by accident.
    results = await asyncio.gather(*(_post(client, SLOW) for _ in range(3)))
    assert [status for status, _ in results] == [200] * 3
    assert tally.served == 6 and tally.wait_s > 0.0
    workers = await (await client.get("/workers", headers=_key("c"))).json()
    assert {w["seats"] for w in workers["data"]} == {1}
    assert workers["queue"]["c"]["standard"]["served"] == 6


async def test_the_default_spare_seat_keeps_one_request_waiting_in_the_engine(
    fleet: Callable[..., Any],
) -> None:
    """With the default config a one-slot worker has two seats: a second request goes
    to it at once (it waits in the engine for the slot), a third waits in the router."""
    client, queue = await fleet(1, queue_spare_seats=RouterConfig().queue_spare_seats)
    tally = queue.stats.tallies["c", "standard"]
    first = [asyncio.create_task(_post(client, BLOCK)) for _ in range(2)]
    await wait_until(lambda: queue.active == 2)
    assert queue.waiting == 0 and tally.wait_s == 0.0  # both seated on arrival
    third = asyncio.create_task(_post(client, SLOW))
    await wait_until(lambda: queue.waiting == 1)  # no third seat: it waits here
    assert [status for status, _ in await asyncio.gather(*first, third)] == [200] * 3
    assert tally.served == 3 and tally.wait_s > 0.0
    workers = await (await client.get("/workers", headers=_key("c"))).json()
    assert [w["seats"] for w in workers["data"]] == [2]


async def test_interactive_jumps_batch(fleet: Callable[..., Any]) -> None:
    client, queue = await fleet(1)
    order: list[str] = []

    async def send(name: str, **fields: Any) -> None:
        status, _ = await _post(client, BLOCK if name == "first" else SLOW, **fields)
        assert status == 200
        order.append(name)

    tasks = [asyncio.create_task(send("first"))]
    await wait_until(lambda: queue.active == 1)
    for i in range(3):  # the batch backlog, queued before the interactive request
        tasks.append(asyncio.create_task(send(f"batch{i}", service_tier="flex")))
        await wait_until(lambda i=i: queue.waiting == i + 1)
    tasks.append(asyncio.create_task(send("interactive", service_tier="priority")))
    await wait_until(lambda: queue.waiting == 4)
    await asyncio.gather(*tasks)
    assert order == ["first", "interactive", "batch0", "batch1", "batch2"]
    assert queue.stats.tallies["c", "interactive"].served == 1
    assert queue.stats.tallies["c", "batch"].served == 3
    # The four that waited were placed on the one worker: their best (none predicted
    # better elsewhere), and /metrics says so.
    assert queue.stats.placed == {"best": 4, "urgent": 0, "held": 0, "near": 0}
    text = await (await client.get("/metrics")).text()
    assert 'radix_router_queue_placed_total{placed="best"} 4.0' in text


async def test_flooding_tenant_does_not_hold_back_another(fleet: Callable[..., Any]) -> None:
    """Tenant a fills the queue far past its share; tenant c's request, arriving behind
    all of it, is seated within one quantum of a's requests, not after the backlog."""
    tenants = {**TENANTS, "a": {"keys": ["key-a"]}}  # no bound on a's queue
    client, queue = await fleet(1, queue_quantum=2, tenants=tenants)
    order: list[str] = []

    async def send(tenant: str, name: str) -> None:
        status, _ = await _post(client, BLOCK if name == "a0" else SLOW, tenant)
        assert status == 200
        order.append(name)

    tasks = [asyncio.create_task(send("a", "a0"))]
    await wait_until(lambda: queue.active == 1)
    for i in range(1, 9):
        tasks.append(asyncio.create_task(send("a", f"a{i}")))
        await wait_until(lambda i=i: queue.waiting == i)
    tasks.append(asyncio.create_task(send("c", "c")))
    await wait_until(lambda: queue.waiting == 9)
    await asyncio.gather(*tasks)
    # a0 was running; a started waiting with 2 requests of credit, c with 2 on arrival:
    # at most a's credit of its backlog goes before c (FIFO alone would put c 10th).
    assert order.index("c") <= 3, order
    assert order.index("c") < order.index("a5")


async def test_429_names_the_bound_and_spares_other_tenants(fleet: Callable[..., Any]) -> None:
    client, queue = await fleet(1)
    blocker = asyncio.create_task(_post(client, BLOCK, "c"))
    await wait_until(lambda: queue.active == 1)
    waiting = [asyncio.create_task(_post(client, SLOW, "a")) for _ in range(2)]
    await wait_until(lambda: queue.waiting == 2)
    # Tenant a is at its max_queue (2): its next request is refused at once...
    r = await client.post("/v1/completions", json=SLOW, headers=_key("a"))
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    error = (await r.json())["error"]
    assert "max_queue" in error["message"] and "'a'" in error["message"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    # ...while tenant c is not refused for it: it waits its turn and is served.
    other = asyncio.create_task(_post(client, SLOW, "c"))
    # Tenant b waits at most 0.3 s (max_queue_wait_s); the seat stays taken longer.
    status, body = await _post(client, SLOW, "b")
    assert status == 429 and "max_queue_wait_s" in body["error"]["message"]
    assert body["error"]["code"] == "queue_timeout"
    results = await asyncio.gather(blocker, other, *waiting)
    assert [status for status, _ in results] == [200] * 4
    text = await (await client.get("/metrics", headers=_key("c"))).text()
    assert 'radix_router_queue_refused_total{class="standard",tenant="a"} 1.0' in text
    assert 'radix_router_queue_refused_total{class="standard",tenant="b"} 1.0' in text
    assert 'radix_router_queue_served_total{class="standard",tenant="c"} 2.0' in text


async def test_a_bad_class_is_400_naming_the_field(fleet: Callable[..., Any]) -> None:
    client, queue = await fleet(1)
    for fields, param in (
        ({"service_tier": "turbo"}, "service_tier"),
        ({"service_tier": 3}, "service_tier"),
        ({"priority": "1"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": 10**40}, "priority"),
    ):
        status, body = await _post(client, FAST, **fields)
        assert status == 400 and body["error"]["param"] == param, (fields, body)
    # A good integer priority goes through, as its class (batch above 0).
    status, _ = await _post(client, FAST, priority=3)
    assert status == 200 and queue.stats.tallies["c", "batch"].served == 1


async def test_an_engine_scheduling_by_priority_gets_the_class_as_priority(
    fake_workers: StartWorkers, start_router: StartRouter, redis_server: RedisServer
) -> None:
    """An attached vLLM run with priority scheduling (its heartbeat says so) gets the
    class's integer `priority` added where the body names only a tier; other workers
    get the body as sent."""
    [(vllm, vllm_server), (plain, plain_server)] = await fake_workers("ok", "ok")
    redis = Redis.from_url(redis_server.url)
    registry = Registry(redis)
    for name, server, by_priority in (("v", vllm_server, True), ("p", plain_server, False)):
        record = WorkerRecord(
            name, url_of(server), "m", "vllm", 1.0, max_running_requests=8,
            priority_scheduling=by_priority,
        )  # fmt: skip
        await registry.publish_heartbeat(record, 60, joined=True)
    client = await start_router(
        redis_url=redis_server.url, discovery_interval=0.1, policy="round_robin"
    )
    await wait_until(lambda: len(client.server.app[FLEET].workers) == 2, 10)
    for fields in ({"service_tier": "priority"}, {"service_tier": "flex", "priority": 4}, {}):
        for _ in range(2):  # round robin: one to each
            r = await client.post("/v1/completions", json={**FAST, "model": "m", **fields})
            assert r.status == 200
    assert [b.get("priority") for b in vllm.bodies_seen] == [-1, 4, None]
    assert [b.get("priority") for b in plain.bodies_seen] == [None, 4, None]
    assert all(b.get("service_tier") == "priority" for b in vllm.bodies_seen[:1])
    await redis.aclose()
