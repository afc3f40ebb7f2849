import asyncio
import json

import pytest
from redis.asyncio import Redis

from shared import registry as registry_module
from shared.redis_server import RedisServer
from shared.registry import Registry, WorkerRecord


@pytest.fixture
def registry(redis: Redis) -> Registry:
    return Registry(redis, prefix="t:")


def record(wid: str = "w1", url: str = "http://127.0.0.1:9001", **kw: object) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=url, model="m", engine="sim", epoch=1.5, **kw)  # type: ignore[arg-type]


async def test_heartbeat_round_trip_and_expiry(registry: Registry) -> None:
    rec = record(running=2, waiting=3, kv_capacity_tokens=100, draining=True)
    await registry.publish_heartbeat(rec, ttl_s=0.3, joined=False)
    assert await registry.read_fleet() == {"w1": rec}
    await asyncio.sleep(0.5)
    assert await registry.read_fleet() == {}
    # the expired id was pruned from the set
    assert await registry.redis.smembers(registry.workers_key) == set()


async def test_join_and_leave_events(registry: Registry) -> None:
    pubsub = registry.redis.pubsub()
    await pubsub.subscribe(registry.events_channel)
    await pubsub.get_message(timeout=1)  # subscribe confirmation
    rec = record()
    await registry.publish_heartbeat(rec, ttl_s=5, joined=True)
    await registry.leave(rec)
    events = []
    for _ in range(2):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert msg is not None
        events.append(json.loads(msg["data"])["event"])
    assert events == ["join", "leave"]
    assert await registry.read_fleet() == {}
    await pubsub.aclose()


async def test_malformed_records_are_ignored(registry: Registry) -> None:
    await registry.publish_heartbeat(record("good"), ttl_s=5, joined=False)
    bad = {
        "worker_id": "evil",
        "url": "file:///etc/passwd",
        "model": "m",
        "engine": "sim",
        "epoch": "1",
    }
    await registry.redis.hset(registry.worker_key("evil"), mapping=bad)
    await registry.redis.hset(registry.worker_key("half"), mapping={"worker_id": "half"})
    await registry.redis.sadd(registry.workers_key, "evil", "half")
    assert list(await registry.read_fleet()) == ["good"]


async def test_a_flooded_id_set_is_read_only_up_to_the_bound(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that may heartbeat may flood the id set; a poll reads about MAX_WORKERS of
    it, never the whole set (each id read is one rejection here: none has a record)."""
    monkeypatch.setattr(registry_module, "MAX_WORKERS", 50)
    await registry.redis.sadd(registry.workers_key, *[f"bad id {i}" for i in range(5000)])
    assert await registry.read_fleet() == {}
    assert 1 < registry.rejections.counts["registry"] <= 50 + 1


def test_server_restarts_on_same_port(redis_server: RedisServer) -> None:
    port = redis_server.port
    redis_server.stop()
    assert not redis_server.running
    redis_server.start()
    assert redis_server.running and redis_server.port == port
