"""A rolling restart as Kubernetes does it, simulated with real processes: under steady
load (streams and plain requests), a new worker joins and an old one gets SIGTERM, then
a new router replica becomes ready and an old one gets SIGTERM. Not one request fails.

What stands in for the cluster: the client sends each request to a router replica
chosen round robin among those whose `/readiness` answered 200 at the last poll (every
100 ms), as a Service's endpoints follow readiness. The chart's timings are kept in
proportion: routers keep serving for `shutdown_delay` after SIGTERM (the chart's preStop
sleep) and workers leave Redis, keep serving for `shutdown_delay`, then drain.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from loadtests.load.cluster import Child, Cluster, WorkerSpec
from loadtests.load.traffic import Outcome, call, failures, prompt, session
from shared.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
WORKER = WorkerSpec(decode_ms=20.0, extra=("--shutdown-delay", "1.0", "--log-level", "WARNING"))
ROUTER = {"shutdown_delay": 1.5, "sync": True, "drain_timeout": 20}


class ReadyEndpoints:
    """The Service: router URLs whose /readiness said 200 at the last poll."""

    def __init__(self, http: aiohttp.ClientSession, routers: list[Child]) -> None:
        self.http, self.routers = http, routers
        self.ready: list[str] = []
        self._turn = itertools.count()

    async def poll_forever(self) -> None:
        while True:
            ready = []
            for r in list(self.routers):
                try:
                    async with self.http.get(
                        r.url + "/readiness", timeout=aiohttp.ClientTimeout(total=0.5)
                    ) as resp:
                        if resp.status == 200:
                            ready.append(r.url)
                except (aiohttp.ClientError, TimeoutError):
                    pass
            self.ready = ready
            await asyncio.sleep(0.1)

    def pick(self) -> str:
        assert self.ready, "no router endpoint is ready"
        return self.ready[next(self._turn) % len(self.ready)]


@pytest.fixture
def fleet() -> Iterator[Cluster]:
    with Cluster() as f:
        for wid in ("w0", "w1"):
            f.start_worker(wid, WORKER, wait=False)
        for child in f.workers.values():
            wait_until(lambda c=child: _ok(c.url + "/health"), 45, child)
        yield f


def _ok(url: str) -> bool:
    from shared.procs import http_json

    try:
        return http_json(url, timeout=1.0)[0] == 200
    except OSError:
        return False


async def test_rolling_restart_of_workers_and_routers_fails_no_request(fleet: Cluster) -> None:
    r0 = fleet.start_router(ROUTER)
    r1 = fleet.add_router("r1", ROUTER)
    routers = [r0, r1]
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    async with session(60) as http:
        endpoints = ReadyEndpoints(http, routers)
        poller = asyncio.create_task(endpoints.poll_forever())
        await _until(lambda: len(endpoints.ready) == 2)

        async def client(i: int) -> None:
            for n in itertools.count(i * 10_000):
                if stop.is_set():
                    return
                body = {**prompt(n, tokens=12), "stream": n % 2 == 0}
                outcomes.append(await call(http, endpoints.pick() + "/v1/completions", body))

        clients = [asyncio.create_task(client(i)) for i in range(8)]
        await _until(lambda: len(outcomes) >= 40)

        # Workers: a new one joins, then the old one gets SIGTERM (deregister, serve, drain).
        await asyncio.to_thread(fleet.start_worker, "w2", WORKER)
        await _until(lambda: all(fleet.routable(r) == 3 for r in routers))
        before = len(outcomes)
        fleet.workers["w0"].signal(signal.SIGTERM)
        assert await asyncio.to_thread(fleet.workers["w0"].wait, 30) == 0
        fleet.adopt(fleet.workers.pop("w0"))  # gone from the fleet (its log stays)
        await _until(lambda: len(outcomes) >= before + 40)

        # Routers: a new replica becomes ready, then the old one gets SIGTERM.
        r2 = await asyncio.to_thread(fleet.add_router, "r2", ROUTER)
        routers.append(r2)
        await _until(lambda: r2.url in endpoints.ready)
        before = len(outcomes)
        r0.signal(signal.SIGTERM)
        assert await asyncio.to_thread(r0.wait, 30) == 0
        await _until(lambda: len(outcomes) >= before + 40)

        stop.set()
        await asyncio.gather(*clients)
        poller.cancel()
    assert len(outcomes) >= 120
    assert not failures(outcomes), failures(outcomes)[:5]
    served_by = {o.worker for o in outcomes}
    assert {"w1", "w2"} <= served_by and "w0" in served_by


async def _until(check, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)
