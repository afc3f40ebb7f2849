"""Faults with real processes: sim workers, a real Redis, the router. Nothing lost.

Each test prints its record (sent / ok / failed / retried / recovery time) so the
numbers in loadtests/RESULTS.md come from these runs (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from loadtests.load.cluster import Cluster, WorkerSpec, wait_health
from router.http.app import create_app
from router.http.state import DISCOVERY, FLEET, METRICS, POLICY
from shared.config import RouterConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


# Sim workers as `start_sim_worker` made them: no cost unless a test gives one.
QUICK = WorkerSpec(
    decode_ms=0.0, cache_tokens=20_000, max_running=64, extra=("--log-level", "WARNING")
)


@pytest.fixture
def bench() -> Iterator[Cluster]:
    """Redis and the workers each test starts, as processes; the router runs in process."""
    with Cluster() as f:
        yield f


async def start_router(bench: Cluster, n: int, **kw: object) -> TestServer:
    assert bench.redis is not None
    config = RouterConfig(
        redis_url=bench.redis.url,
        discovery_interval=0.1,
        host="127.0.0.1",
        retry_backoff=0.01,
        **kw,
    )
    server = TestServer(create_app(config), host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    await wait_until(lambda: len(server.app[FLEET].workers) == n, 15)
    return server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def prompt(i: int) -> dict:
    return {"prompt": f"group {i % 8} " * 50 + f"tail {i}", "max_tokens": 4}


async def test_sigkill_under_load_loses_nothing(
    bench: Cluster, http: aiohttp.ClientSession
) -> None:
    for i in range(3):
        bench.start_worker(f"w{i}", replace(QUICK, decode_ms=5.0))
    router = await start_router(bench, 3)
    url = str(router.make_url("/v1/completions"))
    victim = bench.workers["w0"]

    async def one(i: int) -> int:
        async with http.post(url, json=prompt(i)) as r:
            await r.read()
            return r.status

    async def stream_one(i: int) -> str:
        async with http.post(url, json={**prompt(i), "max_tokens": 40, "stream": True}) as r:
            return (await asyncio.wait_for(r.read(), 30)).decode()

    tasks = [asyncio.create_task(one(i)) for i in range(200)]
    streams = [asyncio.create_task(stream_one(i)) for i in range(6)]
    await wait_until(lambda: router.app[FLEET].workers["w0"].in_flight > 0)  # it holds some
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    statuses = await asyncio.gather(*tasks)
    bodies = await asyncio.gather(*streams)
    await wait_until(lambda: "w0" not in router.app[FLEET].workers, 10)
    retried = router.app[METRICS].retries._value.get()
    print(f"\nSIGKILL: sent 200, ok {statuses.count(200)}, failed {200 - statuses.count(200)}, "
          f"retried {retried:.0f}, left routing {time.monotonic() - killed_at:.2f}s after the kill")  # fmt: skip
    assert statuses == [200] * 200
    for body in bodies:  # each stream finished, or ended with a clear error event; none hung
        events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1])
    assert "w0" not in router.app[POLICY].worker_stats()
    assert all(w.in_flight == 0 for w in router.app[FLEET].workers.values())
    # Out of routing: no later request is tried on it (no retry, no failure).
    assert await asyncio.gather(*(one(i) for i in range(200, 220))) == [200] * 20
    assert router.app[METRICS].retries._value.get() == retried
    await router.close()


async def test_restarted_worker_gets_its_tree_dropped(
    bench: Cluster, http: aiohttp.ClientSession
) -> None:
    bench.start_worker("w0", QUICK)
    router = await start_router(bench, 1)
    url = str(router.make_url("/v1/completions"))
    for i in range(4):
        async with http.post(url, json=prompt(i)) as r:
            assert r.status == 200
    policy, fleet = router.app[POLICY], router.app[FLEET]
    epoch = fleet.workers["w0"].report.epoch
    assert policy.worker_stats()["w0"]["tree_chars"] > 0
    bench.workers["w0"].signal(signal.SIGKILL)
    bench.workers["w0"].wait(10)
    bench.restart_worker("w0")  # same id and port: a new epoch
    await wait_until(
        lambda: "w0" in fleet.workers and fleet.workers["w0"].report.epoch != epoch, 15
    )
    assert policy.worker_stats().get("w0", {}).get("tree_chars", 0) == 0
    for i in range(10):
        async with http.post(url, json=prompt(i)) as r:
            assert r.status == 200
    await router.close()


async def test_redis_outage_keeps_routing(bench: Cluster, http: aiohttp.ClientSession) -> None:
    for i in range(2):
        bench.start_worker(f"w{i}", QUICK)
    router = await start_router(bench, 2, reconnect_grace=3.0)
    redis = bench.redis
    assert redis is not None
    url = str(router.make_url("/v1/completions"))
    statuses: list[int] = []

    async def load(seconds: float) -> None:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            async with http.post(url, json=prompt(i)) as r:
                await r.read()
                statuses.append(r.status)
            i += 1

    await load(0.3)
    redis.stop()
    await wait_until(lambda: not router.app[DISCOVERY].connected, 10)
    await load(2.0)  # Redis down
    assert len(router.app[FLEET].workers) == 2
    redis.start()
    recovered = await wait_until(lambda: router.app[DISCOVERY].connected, 15)
    await load(1.0)
    polls = router.app[DISCOVERY].polls
    await wait_until(lambda: router.app[DISCOVERY].polls >= polls + 3, 10)  # it did look again
    print(
        f"\nRedis outage: sent {len(statuses)}, ok {statuses.count(200)}, reconnected in {recovered:.2f}s"
    )
    assert statuses and all(s == 200 for s in statuses)
    assert set(router.app[FLEET].workers) == {"w0", "w1"}
    await router.close()


async def test_router_sigterm_drains_in_flight_streams(
    bench: Cluster, http: aiohttp.ClientSession
) -> None:
    bench.start_worker("w0", replace(QUICK, decode_ms=40.0))
    router = bench.start_router()
    wait_health(router, 30)
    body = {"prompt": "drain me", "max_tokens": 40, "stream": True}
    async with http.post(router.url + "/v1/completions", json=body) as r:
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        router.signal(signal.SIGTERM)

        async def health() -> int:
            async with http.get(router.url + "/health") as h:
                return h.status

        async with asyncio.timeout(10):  # stops taking work while it drains
            while await health() != 503:
                await asyncio.sleep(0.05)
        rest = await asyncio.wait_for(r.read(), 20)
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert await asyncio.to_thread(router.wait, 20) == 0
