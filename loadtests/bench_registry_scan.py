"""The cost of one read of the fleet registry: SCAN over the worker hashes (now) vs the
shared id set read by SMEMBERS (before issue 21), side by side on one local Redis.

    python -m loadtests registry-scan [--workers 1000] [--other-keys 0,10000,100000]
        [--reads 20]

Each router replica reads the whole registry once per `discovery_interval` (1 s by
default). Both ways then fetch every record with one pipelined HGETALL; they differ in
how they find the ids: `SMEMBERS` of one set (one round trip, any worker could DEL it)
or `SCAN MATCH <prefix>worker:* TYPE hash` (`shared/wire/registry.py`), which walks the whole
database, so the other keys in it (rate-limit cells, one per active client; router load
hashes; the sync stream) are part of its cost. Wall time per read, median of `--reads`,
with the Redis server on the same machine; `round trips` counts the SCAN calls; `server
µs` is the server's own time per read (INFO commandstats), the part every router replica
adds to the one shared Redis. The whole read is mostly parsing the 1,000 records.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from shared.redis_server import RedisServer
from shared.wire.registry import SCAN_COUNT, Registry, WorkerRecord


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=1000, help="worker hashes (default: 1000)")
    ap.add_argument("--other-keys", default="0,10000,100000",
                    help="keys besides the workers, e.g. rate-limit cells (default: %(default)s)")  # fmt: skip
    ap.add_argument("--reads", type=int, default=20, help="reads timed per row (default: 20)")


async def _fill(redis: Redis, registry: Registry, workers: int, others: int) -> None:
    await redis.flushdb()
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(workers):
            wid = f"w{i}"
            record = WorkerRecord(wid, f"http://10.0.{i // 250}.{i % 250}:8001", "m", "sim", 1.0)
            pipe.hset(registry.worker_key(wid), mapping=record.to_hash())
            pipe.sadd(f"{registry.prefix}workers", wid)  # the old layout, for the baseline
        for i in range(others):
            pipe.set(registry.ratelimit_key(f"{i:032x}"), "1.0")
        await pipe.execute()


async def _old_ids(redis: Redis, registry: Registry) -> list[str]:
    return sorted(m.decode() for m in await redis.smembers(f"{registry.prefix}workers"))


async def _old_read(redis: Redis, registry: Registry) -> int:
    """The pre-issue-21 read: the id set, then every hash, parsed as now."""
    ids = await _old_ids(redis, registry)
    async with redis.pipeline(transaction=False) as pipe:
        for wid in ids:
            pipe.hgetall(registry.worker_key(wid))
        return len([WorkerRecord.from_hash(h) for h in await pipe.execute() if h])


async def _timed(read: Callable[[], Awaitable[object]], reads: int) -> float:
    await read()  # warm
    times = []
    for _ in range(reads):
        start = time.perf_counter()
        await read()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


async def _run(args: argparse.Namespace) -> None:
    with RedisServer() as server:
        redis = Redis.from_url(server.url)
        registry = Registry(redis)
        print(f"{args.workers} workers, SCAN COUNT {SCAN_COUNT}, median of {args.reads} reads")
        print("| other keys | ids: SMEMBERS ms | ids: SCAN ms | SCAN round trips | "
              "server µs SMEMBERS / SCAN | whole read before ms | whole read now ms | × |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for others in (int(x) for x in args.other_keys.split(",") if x):
            await _fill(redis, registry, args.workers, others)
            keys = await redis.dbsize()
            assert len(await registry.read_fleet()) == args.workers
            assert await _old_read(redis, registry) == args.workers
            await redis.config_resetstat()
            old_ids_ms = await _timed(lambda: _old_ids(redis, registry), args.reads)
            new_ids_ms = await _timed(registry._worker_ids, args.reads)
            stats = await redis.info("commandstats")
            server_us = {c: stats[f"cmdstat_{c}"]["usec"] / (args.reads + 1)
                         for c in ("smembers", "scan")}  # fmt: skip
            old_ms = await _timed(lambda: _old_read(redis, registry), args.reads)
            new_ms = await _timed(registry.read_fleet, args.reads)
            trips = 0
            cursor = None
            while cursor != 0:
                cursor, _ = await redis.scan(cursor or 0, match=registry.worker_pattern,
                                             count=SCAN_COUNT, _type="hash")  # fmt: skip
                trips += 1
            print(f"| {others:,} ({keys:,} in the db) | {old_ids_ms:.1f} | {new_ids_ms:.1f} | "
                  f"{trips} | {server_us['smembers']:.0f} / {server_us['scan']:.0f} | {old_ms:.1f} | {new_ms:.1f} | {new_ms / old_ms:.2f} |",
                  flush=True)  # fmt: skip
        await redis.aclose()


def main(args: argparse.Namespace) -> int:
    asyncio.run(_run(args))
    return 0
