"""A stock engine's KV events with a gap its replay cannot serve: the router rebuilds that
worker's index instead of leaving it on the tree until the engine clears its cache.

vLLM is faked here (tests/worker/attach/test_kv_subscriber.py's `Publisher`: real ZMQ sockets,
vLLM's frames and replay protocol; the real vLLM runs in .ci/vllm-tests, 20-45 s a
start). Everything else is real: attach's subscriber and forwarder, a Redis-protocol
server, a sim worker app whose heartbeat names the worker and its KV capacity, and the
router app with `kv_events`, read through /workers, /metrics and the dashboard's data.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
from redis.asyncio import Redis

from router.http.state import FLEET, KV_FEED
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.kv_events import AllBlocksCleared, BlockRemoved, parse_entry
from shared.wire.registry import Registry
from tests.fuzz.conftest import start_router, start_worker, worker_config
from tests.worker.attach.test_kv_subscriber import Publisher, stored
from worker.attach.kv_subscriber import ZmqEventSubscriber, forward
from worker.http.state import STATE

POOL_TOKENS = 16  # the sim worker's KV capacity: 8 blocks of 2 tokens


async def fetch(url: str) -> tuple[dict, str, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/workers") as r:
            workers = {w["worker_id"]: w for w in (await r.json())["data"]}
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
        async with http.get(url + "/dashboard.json") as r:
            rows = {w["worker_id"]: w for w in (await r.json())["workers"]}
    return workers, metrics, rows


async def until(check, what: str, rounds: int = 400) -> None:
    for _ in range(rounds):
        if await check():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never: {what}")


async def test_an_unrecoverable_gap_rebuilds_then_turnover_restores_trust(
    redis_server: RedisServer, redis: Redis
) -> None:
    worker = await start_worker(worker_config(
        redis_url=redis_server.url, worker_id="v1", heartbeat_interval=0.2,
        cache_tokens=POOL_TOKENS, advertise_url="http://127.0.0.1:9",
    ))  # fmt: skip
    router = await start_router(RouterConfig(
        host="127.0.0.1", redis_url=redis_server.url, discovery_interval=0.1,
        kv_events=True, tokenizer="sim", access_log=False,
    ))  # fmt: skip
    url = str(router.make_url("")).rstrip("/")
    feed = router.app[KV_FEED]
    pub = Publisher()
    await pub.publish([AllBlocksCleared(), stored(1, None, 1)], send=False)  # history
    queue: asyncio.Queue = asyncio.Queue(maxsize=100)
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, queue)
    epoch = worker.app[STATE].epoch
    registry = Registry(redis)
    tasks = [
        asyncio.create_task(sub.run()),
        asyncio.create_task(forward(queue, registry, "v1", lambda: epoch, 1000)),
    ]

    async def status() -> str | None:
        workers, _, _ = await fetch(url)
        return workers["v1"]["kv_events"] if "v1" in workers else None

    try:
        await until(lambda: _has(router, "v1"), "the router found the worker")
        model = router.app[FLEET].workers["v1"].report.model
        for i in range(2, 60):  # PUB drops what it sends before the SUB is connected
            await pub.publish([stored(i, i - 1, i)])
            if sub.received:
                break
            await asyncio.sleep(0.05)
        await until(lambda: _is(status(), "ok"), "trusted")
        assert feed.match(model, [1, 1]) == {"v1": 2}

        # vLLM's replay buffer lost a batch: the subscriber cannot fill the hole.
        await pub.publish([BlockRemoved((1,))], send=False, keep=False)  # never seen
        await pub.publish([stored(100, None, 7)])
        await until(lambda: _is(status(), "rebuilding"), "rebuilding")
        assert sub.lost == 1
        # On the stream: the hole, then the writer's resync marker (an empty batch).
        entries = await redis.xrange(registry.kv_events_key("v1"))
        marker = parse_entry("v1", entries[-2][1])
        assert (
            marker.resync
            and marker.batch.events == ()
            and not parse_entry("v1", entries[-1][1]).resync
        )
        assert int(entries[-2][1][b"seq"]) == int(entries[-3][1][b"seq"]) + 2
        # Index ∪ tree: what was stored before the loss is forgotten (block 1 may be the
        # one removed unseen); what is stored after it counts; the index alone is not
        # trusted yet.
        assert feed.match(model, [1, 1]) == {} and feed.match(model, [7, 7]) == {"v1": 2}
        assert not feed.trusted("v1")
        workers, metrics, rows = await fetch(url)
        needed = POOL_TOKENS // 2
        assert workers["v1"]["kv_events_rebuild"] == {"removed": 0, "needed": needed}
        assert rows["v1"]["kv_events"] == "rebuilding"
        assert rows["v1"]["kv_events_rebuild"] == {"removed": 0, "needed": needed}
        assert 'radix_router_kv_events_status{status="rebuilding",worker="v1"} 1.0' in metrics
        assert 'radix_router_kv_events_rebuilds_total{cause="marker"} 1.0' in metrics
        assert 'radix_router_kv_events_rebuild_progress{worker="v1"} 0.0' in metrics

        # The pool turns over: one block short of it is not enough ...
        await pub.publish([BlockRemoved(tuple(range(200, 200 + needed - 1)))])
        await until(lambda: _rebuilt(url, needed - 1), f"{needed - 1} removals counted")
        assert feed.status_of("v1") == "rebuilding"
        _, metrics, _ = await fetch(url)
        share = float(re.search(r'rebuild_progress\{worker="v1"\} (\S+)', metrics).group(1))
        assert share == (needed - 1) / needed
        # ... a host tier's removals are not the GPU pool's ...
        await pub.publish([BlockRemoved((300,), "CPU")])
        # ... and the last one is: the index is trusted alone again.
        await pub.publish([BlockRemoved((301,))])
        await until(lambda: _is(status(), "ok"), "trusted after turnover")
        assert feed.match(model, [7, 7]) == {"v1": 2} and feed.trusted("v1")
        workers, metrics, _ = await fetch(url)
        assert workers["v1"]["kv_events_rebuild"] is None
        assert 'rebuild_progress{worker="v1"}' not in metrics
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pub.close()
        await router.close()
        await worker.close()


async def _has(router, wid: str) -> bool:
    return wid in router.app[FLEET].workers


async def _is(got, want: str) -> bool:
    return (await got) == want


async def _rebuilt(url: str, removed: int) -> bool:
    workers, _, _ = await fetch(url)
    return (workers["v1"]["kv_events_rebuild"] or {}).get("removed") == removed
