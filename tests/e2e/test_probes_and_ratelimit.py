"""Kubernetes-facing behaviour of real router processes: the probes the chart points at,
and the rate limit shared by replicas through one Redis."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest

from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.traffic import prompt, session
from shared.procs import free_port, http_json, wait_until
from tests.helm.chart import container, render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def fleet() -> Iterator[Cluster]:
    with Cluster() as f:
        yield f


def _status(url: str) -> int:
    return http_json(url, timeout=2.0)[0]


def test_chart_probe_paths_answer_as_kubernetes_needs_before_any_worker(fleet: Cluster) -> None:
    """The paths the chart's probes use, asked of a real router with no worker yet: the
    liveness and startup probes pass (no crash loop while models load), readiness fails."""
    router = container(render().get("Deployment", "rr-radix-router-router"), "router")
    live, start = (
        router["livenessProbe"]["httpGet"]["path"],
        router["startupProbe"]["httpGet"]["path"],
    )
    ready = router["readinessProbe"]["httpGet"]["path"]
    r = fleet.start_router({"shutdown_delay": 1.5}, want_workers=0)
    wait_until(lambda: _alive(r.url), 30, r)
    assert _status(r.url + start) == 200
    status, body = http_json(r.url + ready)
    assert status == 503 and "no routable worker" in body["reason"]
    # A worker joins: ready.
    fleet.start_worker("w0", WorkerSpec())
    wait_until(lambda: _status(r.url + ready) == 200, 30, r)
    # SIGTERM: not ready at once, still alive and still serving during shutdown_delay.
    r.signal(signal.SIGTERM)
    wait_until(lambda: _status(r.url + ready) == 503, 5, None)
    assert _status(r.url + live) == 200
    status, _ = http_json(r.url + "/v1/completions", "POST", prompt(1, tokens=2))
    assert status == 200
    assert r.wait(15) == 0


async def test_rate_limit_is_shared_by_two_replicas_through_redis(fleet: Cluster) -> None:
    rate, burst, seconds = 20.0, 5, 3.0
    settings = {"rate_limit_per_key": rate, "rate_limit_burst": burst}
    first = fleet.start_router(settings, want_workers=0)
    wait_until(lambda: _alive(first.url), 30, first)
    port = free_port()
    args = list(first.args)
    args[args.index("--port") + 1] = str(port)
    second = type(first)(
        "router2", args, f"http://127.0.0.1:{port}", first.log.with_name("router2.log"),
        dict(first.env),
    ).start()  # fmt: skip
    try:
        wait_until(lambda: _alive(second.url), 30, second)
        urls = [first.url, second.url]
        admitted = refused = 0
        async with session(10) as http:
            start = time.monotonic()

            async def client(i: int) -> None:
                nonlocal admitted, refused
                n = i
                while time.monotonic() - start < seconds:
                    n += 1
                    url = urls[n % 2] + "/v1/completions"
                    async with http.post(url, json=prompt(n, tokens=1)) as r:
                        await r.read()
                        # No workers: an admitted request gets 503; a limited one 429.
                        if r.status == 429:
                            refused += 1
                        else:
                            admitted += 1

            await asyncio.gather(*(client(i) for i in range(8)))
            elapsed = time.monotonic() - start
        expected = burst + rate * elapsed
        print(f"admitted {admitted}, refused {refused}, expected {expected:.1f} in {elapsed:.2f}s")
        assert refused > admitted  # the clients offered well over twice the rate
        assert abs(admitted - expected) <= 0.1 * expected, (admitted, expected)
    finally:
        second.stop(grace_s=5)


def _alive(url: str) -> bool:
    try:
        return _status(url + "/liveness") == 200
    except OSError:
        return False
