import asyncio
import json

import pytest
from redis.asyncio import Redis

from shared.redis_server import RedisServer
from shared.wire import registry as registry_module
from shared.wire.registry import Registry, WorkerRecord


@pytest.fixture
def registry(redis: Redis) -> Registry:
    return Registry(redis, prefix="t:")


def record(wid: str = "w1", url: str = "http://127.0.0.1:9001", **kw: object) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=url, model="m", engine="sim", epoch=1.5, **kw)  # type: ignore[arg-type]


async def test_heartbeat_round_trip_and_expiry(registry: Registry) -> None:
    rec = record(running=2, waiting=3, kv_capacity_tokens=100, draining=True)
    await registry.publish_heartbeat(rec, ttl_s=0.3, joined=False)
    assert await registry.read_fleet() == {"w1": rec}
    async with asyncio.timeout(5):  # the record expires on its own (ttl 0.3 s)
        while await registry.read_fleet():
            await asyncio.sleep(0.05)


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
    # A record under another worker's key, a key that is not a hash, a bad id in a key.
    await registry.redis.hset(registry.worker_key("thief"), mapping=record("good").to_hash())
    await registry.redis.set(registry.worker_key("string"), "x")
    await registry.redis.hset(registry.worker_key("bad id"), mapping=record("bad id").to_hash())
    assert list(await registry.read_fleet()) == ["good"]
    assert registry.rejections.counts["registry"] == 4  # evil, half, thief, "bad id"


async def test_a_flood_of_worker_keys_is_read_only_up_to_the_bound(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many worker hashes the db holds (an operator's mistake: each worker user
    may write only its own), a poll reads about MAX_WORKERS of them."""
    monkeypatch.setattr(registry_module, "MAX_WORKERS", 50)
    async with registry.redis.pipeline(transaction=False) as pipe:
        for i in range(2000):
            pipe.hset(registry.worker_key(f"w{i}"), mapping=record(f"w{i}").to_hash())
        await pipe.execute()
    assert len(await registry.read_fleet()) == 50
    assert registry.rejections.counts["registry"] == 1


async def test_membership_is_the_heartbeat_hashes_under_the_prefix(redis: Redis) -> None:
    """Glob characters in the prefix are literal: `a*:` sees only its own workers, not
    those of prefix `ab:`; nothing but the worker hashes decides who is in the fleet."""
    star, other = Registry(redis, prefix="a*:"), Registry(redis, prefix="ab:")
    await star.publish_heartbeat(record("w1"), ttl_s=5, joined=False)
    await other.publish_heartbeat(record("w2"), ttl_s=5, joined=False)
    await redis.sadd("a*:workers", "ghost")  # the old id set means nothing now
    assert list(await star.read_fleet()) == ["w1"]
    assert list(await other.read_fleet()) == ["w2"]


def test_server_restarts_on_same_port(redis_server: RedisServer) -> None:
    port = redis_server.port
    redis_server.stop()
    assert not redis_server.running
    redis_server.start()
    assert redis_server.running and redis_server.port == port


async def test_hostile_values_of_this_rounds_heartbeat_fields_reject_only_their_worker(
    registry: Registry,
) -> None:
    """A worker credential writes what it likes into its own hash: the LoRA adapters and
    pin counts (issues 30 and 33's fields) out of bounds or of the wrong type reject that
    one record (counted), never the fleet's other workers, never an exception."""
    from shared.wire.registry import MAX_ADAPTERS, MAX_FIELD_CHARS

    await registry.publish_heartbeat(record("good"), ttl_s=5, joined=False)
    hostile = {
        "adapters": [
            ",".join(f"a{i}" for i in range(MAX_ADAPTERS + 1)),  # one name too many
            "a," + "y" * 300,  # a name longer than any model name (field under 1,024)
            "a,,b", "a,\x00b", "x" * (MAX_FIELD_CHARS + 1),
        ],
        "pins": ["-1", "1.5", "x", str(10**16), "1e30", "9" * 5000],
        "pinned_tokens": ["-5", "nan", ""],
        "kv_block_size": ["-16", "0x10"],
    }  # fmt: skip
    n = 0
    for field, values in hostile.items():
        for value in values:
            wid = f"bad{n}"
            n += 1
            await registry.redis.hset(
                registry.worker_key(wid), mapping={**record(wid).to_hash(), field: value}
            )
    assert list(await registry.read_fleet()) == ["good"]
    assert registry.rejections.counts["registry"] == n
