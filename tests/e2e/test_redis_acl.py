"""The Redis users the README gives for an external Redis, applied as written to a real
Valkey server: each role does all it needs with its own user (a worker heartbeats and
leaves; a router discovers, shares decisions and load, and rate-limits) and nothing
past it (a worker cannot touch another worker's record or the sync stream; a router
cannot write registrations)."""

from __future__ import annotations

import re
import shlex
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError

from router.holdings.sync import DecisionSync
from router.http.ratelimit import RedisGcra
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.registry import Registry, WorkerRecord

README = Path(__file__).resolve().parents[2] / "README.md"
PASSWORDS = {"<worker-password>": "wpw-1", "<router-password>": "rpw-2"}


def readme_acl_lines(worker_id: str) -> list[list[str]]:
    lines = re.findall(r"^ACL SETUSER .*$", README.read_text(), re.M)
    assert len(lines) == 2, lines
    out = []
    for line in lines:
        line = line.replace("<worker-id>", worker_id)
        for placeholder, password in PASSWORDS.items():
            line = line.replace(placeholder, password)
        out.append(shlex.split(line))
    return out


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def users(redis_server: RedisServer) -> AsyncIterator[tuple[Redis, Redis, Redis]]:
    admin = Redis.from_url(redis_server.url)
    await admin.flushdb()
    for args in readme_acl_lines("w0"):
        await admin.execute_command(*args)
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    worker = Redis.from_url(f"redis://radix-worker-w0:wpw-1@127.0.0.1:{port}/0")
    router = Redis.from_url(f"redis://radix-router:rpw-2@127.0.0.1:{port}/0")
    yield admin, worker, router
    for client in (worker, router, admin):
        await client.aclose()


def record(wid: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url="http://10.0.0.5:8001", model="m", engine="sim",
                        epoch=1.0)  # fmt: skip


async def test_each_role_does_its_job_with_its_own_user(users: tuple[Redis, Redis, Redis]) -> None:
    _admin, worker, router = users
    mine = Registry(worker)
    await mine.publish_heartbeat(record("w0"), ttl_s=5, joined=True)
    assert list(await Registry(router).read_fleet()) == ["w0"]
    await mine.leave(record("w0"))
    await mine.publish_heartbeat(record("w0"), ttl_s=5, joined=False)

    config = RouterConfig(sync=True)
    seen: list[tuple[str, str]] = []
    sync = DecisionSync(router, Registry(router), config,
                        observe=lambda w, t, now: seen.append((w, t)),
                        local_inflight=lambda: {"w0": 2})  # fmt: skip
    sync.publish("w0", "a decision")
    await sync._send_pending()
    await sync._read_once()  # the first read replays the stream
    assert seen == [("w0", "a decision")]
    await sync._load_once()
    await router.scan(match="radixrouter:router:*")

    # KV events: the worker appends to its own stream, the router reads every stream.
    await mine.append_kv_events("w0", 1.0, 0, b"batch", maxlen=100)
    feed_read = await Registry(router).read_kv_events({"w0": "0"}, 10)
    assert [w for w, _ in feed_read] == ["w0"]
    await Registry(router).trim_kv_events(["w0"], 100)  # a selector allows XTRIM alone
    # ... with MINID too: past an oversized entry (kv_feed), here the one entry
    await Registry(router).trim_kv_events_past("w0", feed_read[0][1][0][0])
    assert await Registry(router).read_kv_events({"w0": "0"}, 10) == []

    limiter = RedisGcra(router, Registry(router), rate=1.0, burst=1)
    assert await limiter.take(b"client-a") == 0.0


async def test_no_role_reaches_past_its_keys(users: tuple[Redis, Redis, Redis]) -> None:
    _admin, worker, router = users
    with pytest.raises(NoPermissionError):
        await Registry(worker).publish_heartbeat(record("w1"), ttl_s=5, joined=False)
    for forbidden in (
        worker.hgetall("radixrouter:worker:w1"),
        worker.xadd("radixrouter:decisions", {"d": b"x"}),
        worker.xadd("radixrouter:kvevents:w1", {"batch": b"x"}),  # another worker's stream
        worker.xread({"radixrouter:kvevents:w0": "0"}),
        router.xadd("radixrouter:kvevents:w0", {"batch": b"x"}),  # routers only read them
        router.delete("radixrouter:kvevents:w0"),  # ... and trim them, nothing more
        router.xdel("radixrouter:kvevents:w0", "0-1"),
        worker.hset("radixrouter:router:r1", mapping={"w0": "1000000"}),
        worker.smembers("radixrouter:workers"),
        # Membership is each worker's own hash: a worker can delete or replace no other.
        worker.delete("radixrouter:worker:w1"),
        worker.unlink("radixrouter:worker:w1"),
        worker.pexpire("radixrouter:worker:w1", 1),
        worker.delete("radixrouter:workers"),  # the old shared id set (issue 21)
        worker.sadd("radixrouter:workers", "w0"),
        worker.srem("radixrouter:workers", "w1"),
        worker.flushdb(),
        router.hset("radixrouter:worker:w9", mapping={"url": "http://169.254.169.254:80"}),
        router.delete("radixrouter:worker:w9"),
        router.sadd("radixrouter:workers", "w9"),
        router.flushdb(),
        worker.config_get("*"),
    ):
        with pytest.raises(NoPermissionError):
            await forbidden
