"""A hung worker, and the router's own SIGTERM, with real router and worker processes.

The hung worker is a TCP server in the test that accepts connections and never answers
a byte: the worst a sick process can do (no reset for the router to notice quickly).
It joins as a static `--worker-url`, so the router knows of it without Redis.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster
from loadtests.load.traffic import burst, call, failures, prompt, session
from shared.procs import http_json
from shared.redis_server import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def fleet2() -> Iterator[Cluster]:
    fleet = sim_cluster(2, WorkerSpec(decode_ms=20.0))
    yield fleet
    fleet.close()


@pytest.fixture
async def hung_url() -> AsyncIterator[str]:
    """Accepts, reads nothing, answers nothing; connections stay open until the test ends."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    port = free_port()
    server = await asyncio.start_server(hold, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    for w in held:
        w.close()
    server.close()
    await server.wait_closed()


async def test_hung_worker_is_timed_out_then_broken_out_of_routing(
    fleet2: Cluster, hung_url: str
) -> None:
    hung_id = hung_url.removeprefix("http://")  # static workers are named host:port
    settings = {"policy": "round_robin", "request_timeout": 1.0, "breaker_failures": 2,
                "breaker_cooldown": 60.0}  # fmt: skip
    router = fleet2.start_router(settings, worker_urls=(hung_url,), want_workers=3)
    url = router.url + "/v1/completions"
    async with session() as http:
        # One at a time: each request that lands on the hung worker waits out the timeout,
        # then is retried on a healthy worker; two such failures open its breaker.
        first = [await call(http, url, prompt(i, tokens=2)) for i in range(8)]
        workers = await asyncio.to_thread(fleet2.router_workers)
        assert workers[hung_id]["breaker"] == "open"
        hung_failures = workers[hung_id]["failures_total"]
        # Now a burst: nobody is sent to the hung worker any more, nobody waits a timeout.
        rest = await burst(http, url, [prompt(i, tokens=5) for i in range(100)])
    assert failures(first) == [] and failures(rest) == []
    assert {o.worker for o in first + rest} == {"w0", "w1"}
    after = await asyncio.to_thread(fleet2.router_workers)
    assert after[hung_id]["failures_total"] == hung_failures == 2
    assert after[hung_id]["in_flight"] == 0  # the timed-out attempts released their guards
    assert max(o.ended - o.started for o in rest) < 30  # none waited on the hung worker


async def test_router_sigterm_finishes_in_flight_then_exits_zero(fleet2: Cluster) -> None:
    router = fleet2.start_router({"drain_timeout": 20.0})
    url = router.url + "/v1/completions"
    async with session() as http:
        plain = [prompt(i, tokens=50) for i in range(40)]  # ≈1 s of decode each
        started = [asyncio.Event() for _ in range(4)]
        streams = [
            call(http, url, {**prompt(i, tokens=100), "stream": True}, first_event=started[i])
            for i in range(4)
        ]
        tasks = asyncio.gather(burst(http, url, plain), asyncio.gather(*streams))
        async with asyncio.timeout(20):
            await asyncio.gather(*(e.wait() for e in started))
        router.signal(signal.SIGTERM)
        signalled = time.monotonic()
        await wait_until(lambda: _status(router.url + "/health") != 200, blocking=True)
        # Draining: new work is refused (503 + Retry-After) or the port is already closed.
        late = await call(http, url, prompt(999, tokens=2), timeout=10)
        health = await asyncio.to_thread(_status, router.url + "/health")
        outcomes, streamed = await tasks
    code = await asyncio.to_thread(router.wait, 30)
    drained = time.monotonic() - signalled
    print(f"\n[router sigterm] in flight {len(outcomes) + len(streamed)}, ok "
          f"{sum(o.ok for o in outcomes + streamed)}, exit {code} after {drained:.2f}s")  # fmt: skip
    assert failures(outcomes) == [] and failures(streamed) == []
    assert all(s.events[-1] == "[DONE]" for s in streamed)
    assert late.status in (503, 0) and not late.ok, late
    assert health in (503, 0)
    assert code == 0
    assert drained < 20.0 + 5.0


def _status(url: str) -> int:
    try:
        return http_json(url, timeout=2.0)[0]
    except OSError:
        return 0  # the listener is gone: also "not accepting"
