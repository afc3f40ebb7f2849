"""Worker and Redis faults under load, every service a real process (loadtests/load/cluster.py).

What the proxy can promise, and so what is asserted:
- A non-streaming answer is sent by the worker only when generation ends (it awaits
  the whole output, then writes headers and body), so a worker killed mid-generation
  fails *before the first byte* reached the router: the router retries on another
  worker and the client sees a 200. Nothing is lost.
- A stream sends its headers after the first token; once the router relayed bytes to
  the client it cannot retry, so a stream cut by the kill must end with an SSE error
  event and a closed connection (never a hang); streams not yet started are retried.

Each test prints its record (`pytest -s`): sent, ok, failed, retried, recovery time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis as redis_sync

from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster, wait_health
from loadtests.load.traffic import SteadyLoad, burst, call, failures, prompt, session
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

HEARTBEAT_S = 0.2  # worker TTL = 3 beats = 0.6 s; router discovery polls every 0.2 s


@pytest.fixture
def fleet3() -> Iterator[Cluster]:
    fleet = sim_cluster(3, WorkerSpec(decode_ms=5.0, heartbeat_s=HEARTBEAT_S))
    yield fleet
    fleet.close()


@pytest.fixture
def fleet2() -> Iterator[Cluster]:
    fleet = sim_cluster(2, WorkerSpec(decode_ms=2.0, heartbeat_s=HEARTBEAT_S))
    yield fleet
    fleet.close()


def record(name: str, sent: int, ok: int, retried: float, recover_s: float) -> None:
    print(f"\n[{name}] sent {sent}, ok {ok}, failed {sent - ok}, retried {retried:.0f}, "
          f"recovered in {recover_s:.2f}s")  # fmt: skip


async def test_sigkill_worker_under_load_loses_no_request(fleet3: Cluster) -> None:
    # round_robin: the victim surely holds a third of the requests and of the streams.
    router = fleet3.start_router({"policy": "round_robin"})
    url = router.url + "/v1/completions"
    async with session() as http:
        plain = [prompt(i, tokens=60) for i in range(200)]  # ≈0.3 s of decode each
        started = [asyncio.Event() for _ in range(12)]
        streams = [  # ≈2 s each: still streaming when the kill comes
            call(http, url, {**prompt(i, tokens=400), "stream": True}, first_event=started[i])
            for i in range(12)
        ]
        tasks = asyncio.gather(burst(http, url, plain), asyncio.gather(*streams))
        async with asyncio.timeout(20):  # every stream under way (headers and a token sent)
            await asyncio.gather(*(e.wait() for e in started))
        fleet3.workers["w0"].signal(9)
        left = await wait_until(
            lambda: "w0" not in fleet3.router_workers(), 10, 0.05, blocking=True
        )
        outcomes, streamed = await tasks
    retried = await asyncio.to_thread(fleet3.router_metric, "radix_router_retries_total")
    record("sigkill", len(outcomes), sum(o.ok for o in outcomes), retried, left)
    assert failures(outcomes) == []  # every non-streaming request answered 200
    assert retried >= 1  # the victim held requests: they went to another worker
    for s in streamed:  # each stream either finished or says why it broke; none hung
        assert s.status == 200 and s.reason == "", s
        assert s.ok or s.stream_error is not None, s.events[-3:]
    broken = [s for s in streamed if not s.ok]
    assert broken and all(s.worker == "w0" for s in broken)
    assert all(s.stream_error["type"] == "server_error" for s in broken)  # type: ignore[index]
    # Its tree is gone with it; nothing is left counted in flight anywhere.
    workers = await asyncio.to_thread(fleet3.router_workers)
    assert set(workers) == {"w1", "w2"}
    assert all(w["in_flight"] == 0 for w in workers.values())
    async with session() as http:
        after = await burst(http, url, [prompt(i, tokens=2) for i in range(20)])
    assert failures(after) == [] and {o.worker for o in after} == {"w1", "w2"}


async def test_restarted_worker_gets_a_new_epoch_and_an_empty_tree(fleet2: Cluster) -> None:
    router = fleet2.start_router()
    url = router.url + "/v1/completions"
    async with session() as http:
        # After the restart new prefixes arrive: the old ones all match w1's tree, and the
        # cache-aware rule rightly keeps them there while load stays balanced.
        phase = [0]

        def body(i: int) -> dict[str, object]:
            return {**prompt(i, tokens=20), "prompt": f"phase {phase[0]} " + prompt(i)["prompt"]}

        load = SteadyLoad(http, url, concurrency=16, body=body).start()
        await load.until_count(60, 30)
        before = await asyncio.to_thread(fleet2.router_workers)
        assert before["w0"]["tree"]["tree_chars"] > 0
        await asyncio.to_thread(fleet2.restart_worker, "w0")
        restarted = time.monotonic()

        def new_epoch() -> bool:
            w0 = fleet2.router_workers().get("w0")
            return w0 is not None and w0["epoch"] != before["w0"]["epoch"]

        await wait_until(new_epoch, 15, 0.05, blocking=True)
        seen = await asyncio.to_thread(fleet2.router_workers)
        # Dropped on the new epoch: what is there now came after the restart only.
        assert seen["w0"]["tree"].get("tree_chars", 0) < before["w0"]["tree"]["tree_chars"]
        back_at = len(load.outcomes)
        phase[0] = 1
        await load.until_count(back_at + 80, 30)
        outcomes = await load.stop()
    after_back = outcomes[back_at:]
    retried = await asyncio.to_thread(fleet2.router_metric, "radix_router_retries_total")
    record("restart", len(outcomes), sum(o.ok for o in outcomes), retried,
           time.monotonic() - restarted)  # fmt: skip
    assert failures(outcomes) == []  # SIGTERM drains the old process: nothing lost at all
    assert failures(after_back) == []
    assert "w0" in {o.worker for o in after_back}  # it is routed to again


async def test_redis_outage_keeps_routing_and_everything_resumes(fleet2: Cluster) -> None:
    router = fleet2.start_router({"reconnect_grace": 3.0})
    url = router.url + "/v1/completions"
    redis = fleet2.redis
    assert redis is not None
    async with session() as http:
        load = SteadyLoad(http, url, concurrency=8, body=lambda i: prompt(i, tokens=5)).start()
        await load.until_count(20, 30)
        await asyncio.to_thread(redis.stop)
        down_at = len(load.outcomes)
        await asyncio.sleep(3.0)  # the router routes on with the last known fleet
        during = load.outcomes[down_at:]
        assert set(await asyncio.to_thread(fleet2.router_workers)) == {"w0", "w1"}
        await asyncio.to_thread(redis.start)
        restarted = time.monotonic()
        client = redis_sync.Redis.from_url(redis.url, socket_timeout=2)
        # Heartbeats resume by themselves: both records are back in the new (empty) Redis.
        await wait_until(
            lambda: client.exists("radixrouter:worker:w0", "radixrouter:worker:w1") == 2,
            15, 0.05, blocking=True,
        )  # fmt: skip
        beats_back = time.monotonic() - restarted
        # Discovery resumes by itself: a worker that joins now is found and routed to.
        await asyncio.to_thread(
            fleet2.start_worker, "w2", WorkerSpec(decode_ms=2.0, heartbeat_s=HEARTBEAT_S)
        )
        await wait_until(lambda: "w2" in fleet2.router_workers(), 15, 0.05, blocking=True)
        outcomes = await load.stop()
        # New prefixes (no tree matches them), so the least loaded worker gets them.
        fresh = [
            {"prompt": f"{i} after the outage, a new text", "max_tokens": 20} for i in range(30)
        ]
        late = await burst(http, url, fresh)
    client.close()
    record("redis outage", len(outcomes), sum(o.ok for o in outcomes), 0, beats_back)
    assert len(during) > 0, "no request was served while Redis was down"
    assert failures(outcomes) == []
    assert failures(late) == [] and "w2" in {o.worker for o in late}
    assert all(c.alive for c in fleet2.workers.values())


async def test_restart_is_seen_even_if_redis_is_slow_to_answer(fleet2: Cluster) -> None:
    """A worker that is back before its record expires keeps its id and is routable."""
    router = fleet2.start_router()
    url = router.url + "/v1/completions"
    await asyncio.to_thread(fleet2.restart_worker, "w1", False)
    await asyncio.to_thread(wait_health, fleet2.workers["w1"])
    await wait_until(lambda: fleet2.routable() == 2, 15, 0.05, blocking=True)
    async with session() as http:
        out = await call(http, url, prompt(1, tokens=2))
    assert out.ok
