"""Fault scenarios at a larger scale than the tests, with a table of what each one cost.

    python -m loadtests faults [--workers 3] [--concurrency 64] [--redis-outage-s 30]
        [--only sigkill,restart,redis,hung,router_sigterm,slowloris,stuck_reader,up_kill]

Each scenario starts a fresh fleet of real processes (Redis, sim workers, the router;
loadtests/load/cluster.py), runs a steady load (`--concurrency` clients, non-streaming, plus a
few streams), injects its fault, keeps the load on, and prints one row:

    sent, ok, failed (any non-200, cut stream, or hang), retried (the router's
    radix_router_retries_total), and time to recover, defined per scenario:
    sigkill   kill -9 → the worker is out of the router's /workers
    restart   SIGTERM → the new process (new epoch) is routable again
    redis     Redis back → every worker's heartbeat record is in Redis again
    hung      a never-answering worker added (admin API) → its breaker is open
    router_sigterm  SIGTERM → the router exited (code shown), in-flight finished
    slowloris, stuck_reader: bad clients, in loadtests/load/faults_clients.py
    up_kill   kill -9 of a worker under `radix-router up` → it is back (new epoch) and
              routed to again (loadtests/load/faults_up.py)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis as redis_sync

from loadtests.load.cluster import sim_fleet
from loadtests.load.faults_clients import CLIENT_SCENARIOS
from loadtests.load.faults_kit import ADMIN_KEY, SPEC, Options, Row, poll, row, with_load
from loadtests.load.faults_up import UP_SCENARIOS
from loadtests.load.traffic import call, prompt, session
from loadtests.options import HelpFormatter
from shared.procs import http_json
from shared.redis_server import free_port


async def sigkill(o: Options) -> Row:
    with sim_fleet(o.workers, SPEC) as fleet:
        fleet.start_router()

        async def fault() -> tuple[float, str]:
            fleet.workers["w0"].signal(signal.SIGKILL)
            return await poll(lambda: "w0" not in fleet.router_workers(), 30), "w0 killed (-9)"

        outcomes, rec, note = await with_load(fleet, o, fault)
        return row("worker SIGKILL", fleet, outcomes, rec, note)


async def restart(o: Options) -> Row:
    with sim_fleet(o.workers, SPEC) as fleet:
        fleet.start_router()

        async def fault() -> tuple[float, str]:
            epoch = fleet.router_workers()["w0"]["epoch"]
            start = time.monotonic()
            await asyncio.to_thread(fleet.restart_worker, "w0")

            def back() -> bool:
                w0 = fleet.router_workers().get("w0")
                return w0 is not None and w0["epoch"] != epoch and w0["breaker"] == "closed"

            await poll(back, 30)
            tree = fleet.router_workers()["w0"]["tree"].get("tree_chars", 0)
            return time.monotonic() - start, f"new epoch seen; w0 tree then {tree} chars"

        outcomes, rec, note = await with_load(fleet, o, fault)
        return row("worker restart", fleet, outcomes, rec, note)


async def redis_outage(o: Options) -> Row:
    with sim_fleet(o.workers, SPEC) as fleet:
        fleet.start_router({"reconnect_grace": 5.0})
        assert fleet.redis is not None
        redis = fleet.redis

        async def fault() -> tuple[float, str]:
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(o.redis_outage_s)
            kept = len(fleet.router_workers())
            await asyncio.to_thread(redis.start)
            client = redis_sync.Redis.from_url(redis.url, socket_timeout=2)
            keys = [f"radixrouter:worker:w{i}" for i in range(o.workers)]
            rec = await poll(lambda: client.exists(*keys) == len(keys), 60)
            client.close()
            return rec, f"Redis down {o.redis_outage_s:.0f}s; router kept {kept} workers"

        outcomes, rec, note = await with_load(fleet, o, fault)
        return row("Redis outage", fleet, outcomes, rec, note)


async def hung(o: Options) -> Row:
    held: list[asyncio.StreamWriter] = []
    port = free_port()
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", port)  # type: ignore[arg-type,return-value]
    try:
        with sim_fleet(o.workers, SPEC) as fleet:
            settings = {"admin_key": ADMIN_KEY, "request_timeout": 2.0, "breaker_failures": 3}
            fleet.start_router(settings)

            async def fault() -> tuple[float, str]:
                body = {"url": f"http://127.0.0.1:{port}", "worker_id": "hung"}
                headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
                status, _ = await asyncio.to_thread(
                    http_json, fleet.router.url + "/workers", "POST", body, headers
                )  # type: ignore[union-attr]
                assert status == 201, status
                rec = await poll(lambda: fleet.router_workers()["hung"]["breaker"] == "open", 60)
                fails = fleet.router_workers()["hung"]["failures_total"]
                return rec, f"timeout 2 s; {fails} attempts timed out before the breaker opened"

            # Fresh prefixes: no tree matches them, so the idle hung worker gets picked
            # (with shared prefixes the cache-aware rule never sends it anything).
            def fresh(i: int) -> dict[str, Any]:
                return {"prompt": f"{i} fresh text " * 10, "max_tokens": o.tokens}

            outcomes, rec, note = await with_load(fleet, o, fault, fresh)
            return row("hung worker", fleet, outcomes, rec, note)
    finally:
        for w in held:
            w.close()
        server.close()


async def router_sigterm(o: Options) -> Row:
    with sim_fleet(o.workers, SPEC) as fleet:
        router = fleet.start_router({"drain_timeout": 30.0})
        url = router.url + "/v1/completions"
        async with session(timeout=120) as http:
            started = [asyncio.Event() for _ in range(4)]
            plain = [call(http, url, prompt(i, 300), 60) for i in range(o.concurrency)]
            streams = [
                call(http, url, {**prompt(i, 600), "stream": True}, 60, first_event=started[i])
                for i in range(4)
            ]
            tasks = asyncio.gather(*plain, *streams)
            async with asyncio.timeout(60):  # every stream under way
                await asyncio.gather(*(e.wait() for e in started))
            router.signal(signal.SIGTERM)
            at = time.monotonic()
            outcomes = await tasks
            code = await asyncio.to_thread(router.wait, 60)
            took = time.monotonic() - at
        in_flight = sum(1 for x in outcomes if x.ended > at)
        note = f"exit code {code}; {in_flight} requests (4 streams) in flight at SIGTERM"
        return Row("router SIGTERM", len(outcomes), sum(x.ok for x in outcomes), 0, took, note)


SCENARIOS = {"sigkill": sigkill, "restart": restart, "redis": redis_outage, "hung": hung,
             "router_sigterm": router_sigterm}  # fmt: skip


def scenarios() -> dict[str, Callable[[Options], Awaitable[Row]]]:
    return {**SCENARIOS, **CLIENT_SCENARIOS, **UP_SCENARIOS}


async def run(names: list[str], o: Options) -> list[Row]:
    rows = []
    table = scenarios()
    for name in names:
        row = await table[name](o)
        print(row.line(), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests faults",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--before-s", type=float, default=5.0, help="load before the fault")
    ap.add_argument("--after-s", type=float, default=5.0, help="load after recovery")
    ap.add_argument("--redis-outage-s", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=40, help="max_tokens per request")
    ap.add_argument("--slow-clients", type=int, default=16, help="slowloris connections")
    ap.add_argument("--only", default=",".join(scenarios()))
    args = ap.parse_args(argv)
    o = Options(args.workers, args.concurrency, args.before_s, args.after_s,
                args.redis_outage_s, args.tokens, args.slow_clients)  # fmt: skip
    print("| fault | sent | succeeded | failed | retried | time to recover (s) | notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = asyncio.run(run(args.only.split(","), o))
    return 0 if all(r.ok == r.sent for r in rows) else 1
