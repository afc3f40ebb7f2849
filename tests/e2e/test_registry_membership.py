"""A worker's Redis credential cannot erase the fleet or stand in for other workers
(issue 21, finding 2). The README's ACL lines are applied as written to a real
Redis-protocol server; two honest sim workers (real apps on loopback) register with
their own users, a real router app discovers them with the routers' user, and a third
worker, `w9`, attacks with its own user while clients send requests through the router.

Before: every worker user could DEL/SREM/SADD the shared id set that decided membership,
so `DEL radixrouter:workers` emptied every router's fleet (503s) and DEL then SADD
itself sent every request to the attacker. Now membership is the heartbeat hashes,
each writable only by its own worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError

from router.http.state import DISCOVERY
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.registry import Registry, WorkerRecord
from tests.e2e.test_redis_acl import readme_acl_lines
from tests.fuzz.conftest import start_router, start_worker, worker_config
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
P = "radixrouter:"
GOOD = {"prompt": "hello", "max_tokens": 2}


@dataclass
class Fleet:
    router: TestServer
    urls: dict[str, str]  # worker id -> its URL (w0, w1 honest; w9 the attacker's own)
    attacker: Redis  # logged in as radix-worker-w9


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def _user_url(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def record(wid: str, url: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=url, model="sim", engine="sim", epoch=1.0)


@pytest.fixture
async def fleet(acl_server: RedisServer) -> AsyncIterator[Fleet]:
    admin = Redis.from_url(acl_server.url)
    await admin.flushdb()
    for wid in ("w0", "w1", "w9"):
        for args in readme_acl_lines(wid):
            await admin.execute_command(*args)
    workers = {wid: await start_worker(worker_config()) for wid in ("w0", "w1", "w9")}
    urls = {wid: str(s.make_url("")).rstrip("/") for wid, s in workers.items()}
    for wid in ("w0", "w1"):  # the honest ones register once, as themselves
        async with Redis.from_url(_user_url(acl_server, f"radix-worker-{wid}", "wpw-1")) as own:
            await Registry(own).publish_heartbeat(record(wid, urls[wid]), 60, joined=True)
    router = await start_router(RouterConfig(
        host="127.0.0.1", policy="round_robin", discovery_interval=0.05, max_retries=0,
        redis_url=_user_url(acl_server, "radix-router", "rpw-2"),
    ))  # fmt: skip
    attacker = Redis.from_url(_user_url(acl_server, "radix-worker-w9", "wpw-1"))
    try:
        await wait_routed(router, {"w0", "w1"})
        yield Fleet(router, urls, attacker)
    finally:
        await attacker.aclose()
        await router.close()
        for server in workers.values():
            await server.close()
        await admin.aclose()


async def routed(router: TestServer) -> dict[str, str]:
    async with aiohttp.ClientSession() as http, http.get(router.make_url("/workers")) as r:
        return {w["worker_id"]: w["url"] for w in (await r.json())["data"]}


async def wait_routed(router: TestServer, ids: set[str]) -> None:
    for _ in range(200):
        if set(await routed(router)) == ids:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"routed {await routed(router)}, expected {ids}")


async def send(router: TestServer, n: int) -> Counter[str]:
    """n requests; which worker answered each (every one must be answered)."""
    by: Counter[str] = Counter()
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            async with http.post(router.make_url("/v1/completions"), json=GOOD) as r:
                assert r.status == 200, await r.text()
                by[r.headers["x-radix-worker"]] += 1
    return by


def erase_others(redis: Redis) -> list[Callable[[], Awaitable[object]]]:
    """Everything a worker user might try to remove or replace the other workers."""
    others = [f"{P}worker:w0", f"{P}worker:w1"]
    leave = json.dumps({"event": "leave", "worker_id": "w0", "url": "http://x:1"})
    return [
        lambda: redis.delete(f"{P}workers"),  # the finding: the old shared id set
        lambda: redis.srem(f"{P}workers", "w0", "w1"),
        lambda: redis.delete(*others),
        lambda: redis.unlink(*others),
        lambda: redis.pexpire(others[0], 1),
        lambda: redis.hset(others[0], mapping={"url": "http://127.0.0.1:9"}),
        lambda: redis.rename(others[1], f"{P}worker:w9"),
        lambda: redis.flushdb(),
        lambda: redis.flushall(),
        lambda: redis.publish(f"{P}events", leave),  # allowed: it only wakes routers
    ]


async def attack(calls: list[Callable[[], Awaitable[object]]]) -> int:
    """Run each call; how many the server accepted."""
    accepted = 0
    for call in calls:
        with contextlib.suppress(NoPermissionError, ResponseError):
            await call()
            accepted += 1
    return accepted


async def test_a_worker_user_cannot_empty_the_fleet(fleet: Fleet) -> None:
    stop = asyncio.Event()

    async def keep_erasing() -> None:
        while not stop.is_set():
            await attack(erase_others(fleet.attacker))
            await asyncio.sleep(0.01)

    erasing = asyncio.create_task(keep_erasing())
    try:
        discovery = fleet.router.app[DISCOVERY]
        polled = discovery.polls
        await wait_until(lambda: discovery.polls >= polled + 3)  # several polls under attack
        by = await send(fleet.router, 10)
    finally:
        stop.set()
        await erasing
    assert by == {"w0": 5, "w1": 5}
    assert await routed(fleet.router) == {w: fleet.urls[w] for w in ("w0", "w1")}


async def test_a_worker_user_cannot_capture_the_traffic(fleet: Fleet) -> None:
    """It removes the others (refused) and registers itself (its right): it becomes one
    worker among three, never the only one, and cannot take another worker's id."""
    assert await attack(erase_others(fleet.attacker)) == 1  # only the harmless publish
    with contextlib.suppress(NoPermissionError, ResponseError):
        await fleet.attacker.sadd(f"{P}workers", "w9")
    await Registry(fleet.attacker).publish_heartbeat(
        record("w9", fleet.urls["w9"]), 60, joined=True
    )
    await wait_routed(fleet.router, {"w0", "w1", "w9"})
    assert await send(fleet.router, 30) == {"w0": 10, "w1": 10, "w9": 10}
    # Its own hash naming another worker is a lie, not a takeover: w9 is dropped instead.
    await fleet.attacker.hset(f"{P}worker:w9", mapping=record("w0", fleet.urls["w9"]).to_hash())
    await wait_routed(fleet.router, {"w0", "w1"})
    assert await routed(fleet.router) == {w: fleet.urls[w] for w in ("w0", "w1")}
    assert await send(fleet.router, 4) == {"w0": 2, "w1": 2}
