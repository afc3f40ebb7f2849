"""Discovery against a real Redis-protocol server: join, expiry, epochs, outages."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.asyncio import Redis

from router.fleet.discovery import Discovery
from router.fleet.table import Fleet
from router.holdings.room import Holdings
from router.policy import build_routing
from router.policy.base import RouteRequest, WorkerView
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.serving.aio import stop_task
from shared.wire.registry import Registry, WorkerRecord
from tests.waiting import ManualClock, wait_until


@pytest.fixture
def registry(redis: Redis) -> Registry:
    return Registry(redis)


def rec(wid: str, port: int, epoch: float = 1.0, **kw: object) -> WorkerRecord:
    return WorkerRecord(wid, f"http://127.0.0.1:{port}", "m", "sim", epoch, **kw)  # type: ignore[arg-type]


async def start(
    redis_server: RedisServer, fleet: Fleet, grace: float = 0.0, clock: ManualClock | None = None
) -> tuple[Discovery, asyncio.Task[None]]:
    discovery = Discovery.from_url(
        redis_server.url, "radixrouter:", fleet, interval=0.1, grace=grace,
        clock=clock if clock is not None else ManualClock(),
    )  # fmt: skip
    return discovery, asyncio.create_task(discovery.run())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_join_expire_leave_and_epoch(redis_server: RedisServer, registry: Registry) -> None:
    config = RouterConfig()
    policy = build_routing(config)
    fleet = Fleet(config, policy.holdings)
    discovery, task = await start(redis_server, fleet)
    try:
        await registry.publish_heartbeat(
            rec("a", 9001, kv_capacity_tokens=1000), ttl_s=30, joined=True
        )
        await registry.publish_heartbeat(rec("b", 9002), ttl_s=0.5, joined=True)
        await wait_until(lambda: set(fleet.workers) == {"a", "b"})
        assert fleet.workers["a"].report.kv_capacity_tokens == 1000
        # b stops heartbeating: it leaves once its hash expires.
        await wait_until(lambda: set(fleet.workers) == {"a"})
        # a restarts: new epoch → its tree is dropped.
        policy.select(RouteRequest("p" * 300), [WorkerView("a", 0)], 0.0)
        assert policy.holdings.worker_stats()["a"]["tree_chars"] >= 300
        await registry.publish_heartbeat(
            rec("a", 9001, epoch=2.0, kv_capacity_tokens=1000), ttl_s=30, joined=True
        )
        await wait_until(lambda: fleet.workers["a"].report.epoch == 2.0)
        assert policy.holdings.worker_stats().get("a", {}).get("tree_chars", 0) == 0
        await registry.leave(rec("a", 9001, epoch=2.0))
        await wait_until(lambda: fleet.workers == {})
    finally:
        await stop(task)
    assert discovery.errors == 0


async def test_malformed_record_is_never_routed(
    redis_server: RedisServer, registry: Registry
) -> None:
    fleet = Fleet(RouterConfig(), Holdings(RouterConfig()))
    _, task = await start(redis_server, fleet)
    try:
        await registry.redis.hset(
            "radixrouter:worker:evil", mapping={**rec("evil", 1).to_hash(), "url": "file:///x"}
        )
        await registry.publish_heartbeat(rec("ok", 9003), ttl_s=30, joined=True)
        await wait_until(lambda: "ok" in fleet.workers)
        assert "evil" not in fleet.workers
    finally:
        await stop(task)


async def test_a_record_cannot_take_over_a_worker_added_by_hand(
    redis_server: RedisServer, registry: Registry
) -> None:
    fleet = Fleet(RouterConfig(), Holdings(RouterConfig()))
    static = fleet.add_url("http://127.0.0.1:9500", "static")
    discovery, task = await start(redis_server, fleet)
    try:
        # Same id (host:port), another URL.
        await registry.publish_heartbeat(rec(static.worker_id, 9004), ttl_s=30, joined=True)
        await registry.publish_heartbeat(rec("ok", 9003), ttl_s=30, joined=True)
        await wait_until(lambda: "ok" in fleet.workers)
        assert static.url == "http://127.0.0.1:9500" and static.source == "static"
        assert discovery.registry.rejections.counts["registry"] >= 1
    finally:
        await stop(task)


async def test_redis_outage_keeps_the_fleet_and_recovers(redis_server: RedisServer) -> None:
    fleet = Fleet(RouterConfig(), Holdings(RouterConfig()))
    clock = ManualClock()
    discovery, task = await start(redis_server, fleet, grace=1.0, clock=clock)
    redis = Redis.from_url(redis_server.url)
    try:
        await Registry(redis).publish_heartbeat(rec("a", 9001), ttl_s=30, joined=True)
        await wait_until(lambda: set(fleet.workers) == {"a"})
        redis_server.stop()
        await wait_until(lambda: not discovery.connected)
        errors = discovery.errors
        await wait_until(lambda: discovery.errors >= errors + 2)  # it kept trying ...
        assert set(fleet.workers) == {"a"}  # ... and kept the last known fleet
        redis_server.start()
        polls = discovery.polls
        await wait_until(lambda: discovery.connected and discovery.polls > polls, timeout=10)
        # The restarted Redis is empty; within the grace the worker stays ...
        await wait_until(lambda: discovery.polls > polls + 1)
        assert set(fleet.workers) == {"a"}
        await redis.aclose()
        redis = Redis.from_url(redis_server.url)  # the old pooled connection died with the server
        await Registry(redis).publish_heartbeat(rec("a", 9001), ttl_s=30, joined=True)
        await Registry(redis).publish_heartbeat(rec("b", 9002), ttl_s=30, joined=True)
        await wait_until(lambda: set(fleet.workers) == {"a", "b"})
        clock.advance(1.0)  # the grace is over: a worker missing from the registry leaves
        await redis.delete(Registry(redis).worker_key("b"))  # its record expired
        await wait_until(lambda: set(fleet.workers) == {"a"})  # ... while a's heartbeat kept it
    finally:
        await stop(task)
        await redis.aclose()


async def test_stops_even_when_a_cancel_is_lost(redis_server: RedisServer) -> None:
    """Python 3.11's asyncio.timeout can turn a cancel that meets its own deadline into a
    TimeoutError that redis-py swallows. The stop flag must end the loops anyway, or the
    router's shutdown hangs (seen once in CI on this very fixture)."""
    fleet = Fleet(RouterConfig(), Holdings(RouterConfig()))
    discovery, task = await start(redis_server, fleet)
    await wait_until(lambda: discovery.polls > 0)

    inside = asyncio.Event()

    async def poll_that_loses_cancels() -> None:
        inside.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)

    discovery.poll_once = poll_that_loses_cancels  # type: ignore[method-assign]
    await asyncio.wait_for(inside.wait(), 5)  # the loop is now inside the cancel-losing poll
    discovery.stopping = True
    await stop_task(task, timeout=3)
    assert task.done()


async def test_a_flood_of_events_wakes_the_poller_only_so_often(
    redis_server: RedisServer, registry: Registry
) -> None:
    """Any worker may publish on the events channel and each wake-up reads every
    worker's record: 0.5 s of events (thousands) buy at most one read per 0.1 s."""
    fleet = Fleet(RouterConfig(), Holdings(RouterConfig()))
    discovery = Discovery.from_url(redis_server.url, "radixrouter:", fleet, interval=30.0,
                                   grace=0.0, clock=ManualClock())  # fmt: skip
    task = asyncio.create_task(discovery.run())
    try:
        await wait_until(lambda: discovery.polls == 1)
        async with asyncio.timeout(5):  # the listener has subscribed
            while not (await registry.redis.pubsub_numsub(registry.events_channel))[0][1]:
                await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        end, sent = loop.time() + 0.5, 0
        while loop.time() < end:
            await registry.redis.publish(registry.events_channel, "{}")
            sent += 1
        assert sent > 100
        assert 2 <= discovery.polls <= 1 + 0.5 / 0.1 + 2, discovery.polls
    finally:
        await stop(task)
