"""Replica sync over a real Redis server: decisions flow between replicas, a late
replica catches up from the stream, and a Redis outage degrades without errors."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from router.holdings.sync import DecisionSync
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.registry import Registry
from tests.waiting import wait_until

CONFIG = RouterConfig(sync=True, sync_flush_interval=0.005, sync_load_interval=0.05)


class Replica:
    def __init__(self, url: str, inflight: dict[str, int] | None = None) -> None:
        self.redis = Redis.from_url(url, socket_timeout=5)
        self.seen: list[tuple[str, str]] = []
        self.inflight = inflight if inflight is not None else {}
        self.sync = DecisionSync(
            self.redis,
            Registry(self.redis, "t:"),
            CONFIG,
            observe=lambda w, text, now: self.seen.append((w, text)),
            local_inflight=lambda: self.inflight,
        )

    async def close(self) -> None:
        await self.sync.stop()
        await self.redis.aclose()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def make(**kw: object) -> Replica:
        replica = Replica(redis_server.url, **kw)  # type: ignore[arg-type]
        made.append(replica)
        return replica

    yield make
    for replica in made:
        await replica.close()


async def test_decisions_reach_the_other_replica_only(replicas: Callable[..., Replica]) -> None:
    a, b = replicas(), replicas()
    await a.sync.start()
    await b.sync.start()
    await asyncio.wait_for(asyncio.gather(a.sync.caught_up.wait(), b.sync.caught_up.wait()), 5)
    a.sync.publish("w1", "system prompt ... turn 1")
    b.sync.publish("w2", "another conversation")
    await wait_until(lambda: b.seen == [("w1", "system prompt ... turn 1")])
    await wait_until(lambda: a.seen == [("w2", "another conversation")])
    # Nobody re-applies its own decisions. Not a wait for nothing: each reader applies the
    # stream in order, so once it has applied a marker published after its own decision
    # (which the other replica already saw in the stream), it has read past that one.
    b.sync.publish("w3", "marker from b")
    a.sync.publish("w4", "marker from a")
    await wait_until(lambda: len(a.seen) == 2 and len(b.seen) == 2)
    assert a.seen == [("w2", "another conversation"), ("w3", "marker from b")]
    assert b.seen == [("w1", "system prompt ... turn 1"), ("w4", "marker from a")]


async def test_late_replica_catches_up_and_text_is_capped(replicas: Callable[..., Replica]) -> None:
    a = replicas()
    await a.sync.start()
    long_text = "x" * (CONFIG.sync_max_chars + 100)
    for i in range(1500):  # more than one replay page
        a.sync.publish(f"w{i % 3}", f"conversation {i}")
    a.sync.publish("w0", long_text)
    await wait_until(lambda: a.sync.published == 1501)
    late = replicas()
    await late.sync.start()
    await asyncio.wait_for(late.sync.caught_up.wait(), 10)
    assert len(late.seen) == 1501
    assert late.seen[0] == ("w0", "conversation 0")
    assert late.seen[-1] == ("w0", long_text[: CONFIG.sync_max_chars])


async def test_inflight_is_shared(replicas: Callable[..., Replica]) -> None:
    a = replicas(inflight={"w1": 3, "w2": 0})
    b = replicas(inflight={"w1": 2})
    await a.sync.start()
    await b.sync.start()
    await wait_until(lambda: dict(a.sync.remote_inflight()) == {"w1": 2})
    await wait_until(lambda: dict(b.sync.remote_inflight()) == {"w1": 3})
    b.inflight["w1"] = 0
    await wait_until(lambda: dict(a.sync.remote_inflight()) == {})


async def test_redis_outage_degrades_and_recovers(
    redis_server: RedisServer, replicas: Callable[..., Replica]
) -> None:
    a, b = replicas(), replicas()
    await a.sync.start()
    await b.sync.start()
    await asyncio.wait_for(asyncio.gather(a.sync.caught_up.wait(), b.sync.caught_up.wait()), 5)
    redis_server.stop()
    a.sync.publish("w1", "during the outage")  # must not raise on the hot path
    await asyncio.sleep(0.3)
    redis_server.start()
    # The buffered decision is delivered once Redis is back.
    await wait_until(lambda: ("w1", "during the outage") in b.seen, timeout=10)
    a.sync.publish("w2", "after the outage")
    await wait_until(lambda: ("w2", "after the outage") in b.seen, timeout=10)


async def test_an_unchanged_round_keeps_the_remote_mapping(
    replicas: Callable[..., Replica],
) -> None:
    """The fleet takes a new mapping for a change of load and walks every worker on the
    next request (router/fleet/columns.py), so a round that changed nothing keeps the old one."""
    a = replicas(inflight={"w1": 0})
    b = replicas(inflight={"w1": 2})
    await b.sync._load_once()
    await a.sync._load_once()
    first = a.sync.remote_inflight()
    assert first == {"w1": 2}
    await a.sync._load_once()
    assert a.sync.remote_inflight() is first
    b.inflight["w1"] = 1
    await b.sync._load_once()
    await a.sync._load_once()
    assert a.sync.remote_inflight() == {"w1": 1}


async def test_a_reader_under_load_reads_once_an_interval_not_once_an_entry(
    redis_server: RedisServer, replicas: Callable[..., Replica]
) -> None:
    """Entries arriving faster than the flush interval are read in batches: a blocked
    read returns at the first entry, so without the wait after a read the reader made a
    round trip per entry of every replica (its own included)."""
    writer = replicas()  # flushes every 5 ms: an entry a decision below
    redis = Redis.from_url(redis_server.url, socket_timeout=5)
    seen: list[tuple[str, str]] = []
    reader = DecisionSync(
        redis, Registry(redis, "t:"),
        RouterConfig(sync=True, sync_flush_interval=0.1, sync_load_interval=0.05),
        observe=lambda w, text, now: seen.append((w, text)), local_inflight=dict,
    )  # fmt: skip
    reads, xread = 0, redis.xread

    async def counted(*args: object, **kw: object) -> object:
        nonlocal reads
        reads += 1
        return await xread(*args, **kw)

    redis.xread = counted  # type: ignore[method-assign]
    try:
        await writer.sync.start()
        await reader.start()
        await asyncio.wait_for(reader.caught_up.wait(), 5)
        start, reads = time.monotonic(), 0
        for i in range(60):  # ~0.6 s: another replica under load
            writer.sync.publish("w1", f"conversation {i}")
            await asyncio.sleep(0.01)
        await wait_until(lambda: len(seen) == 60)
        assert writer.sync.published == 60
        # About one read an interval (0.1 s), not one an entry (~60): the bound grows
        # with the time the writes took on a slow machine (~12 reads at ~0.7 s).
        assert reads <= (time.monotonic() - start) / 0.1 + 5, reads
    finally:
        await reader.stop()
        await redis.aclose()
