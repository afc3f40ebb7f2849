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
              routed to again

`up_kill`: `up` supervises its children (router/up/local_fleet.py, router/up/restarts.py):
the killed worker is reported in one line and restarted on its port after a backoff, and
the router routes around it meanwhile. The time to recover is kill → the new process (a
new epoch) is in the router's `/workers` with a closed breaker; the note says whether `up`
kept running, what it printed about the exit, and how many requests the new process
answered in the `after_s` of load that follow.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis as redis_sync

from loadtests.load.cluster import ROOT, sim_cluster
from loadtests.load.faults_clients import CLIENT_SCENARIOS
from loadtests.load.traffic import (
    ADMIN_KEY,
    SPEC,
    Options,
    Row,
    call,
    cut_note,
    load_around,
    poll,
    prompt,
    row,
    session,
    with_load,
)
from shared.procs import free_port, http_json, wait_until


def _workers(url: str) -> dict[str, dict[str, Any]]:
    try:
        return {w["worker_id"]: w for w in http_json(url + "/workers", timeout=2)[1]["data"]}
    except (OSError, TypeError, KeyError):
        return {}


async def up_kill(o: Options) -> Row:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "router", "up", "--engine", "sim", "--workers", str(o.workers),
            "--port", str(port), "--start-timeout", "90", "--sim-decode-ms-per-token", "3"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                          env=env, text=True, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    assert up.stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        await asyncio.to_thread(
            wait_until, lambda: any("Press Ctrl-C" in ln for ln in lines) or up.poll() is not None,
            120,
        )  # fmt: skip
        if up.poll() is not None:
            raise RuntimeError("radix-router up did not start:\n" + "".join(lines))
        pid = int(next(ln for ln in lines if "worker-0 (pid" in ln).split("(pid ")[1].split(")")[0])

        async def fault() -> tuple[float, str]:
            epoch = _workers(url)["worker-0"]["epoch"]
            os.killpg(pid, signal.SIGKILL)
            start = time.monotonic()

            def back() -> bool:
                w0 = _workers(url).get("worker-0")
                return w0 is not None and w0["epoch"] != epoch and w0["breaker"] == "closed"

            await poll(back, 60)
            return time.monotonic() - start, ""

        # Fresh prefixes: no tree matches them, so the new (empty) worker-0 gets its share
        # (with shared prefixes the cache-aware rule keeps them where they are cached).
        def fresh(i: int) -> dict[str, Any]:
            return {"prompt": f"{i} fresh text " * 10, "max_tokens": o.tokens}

        outcomes, rec, _ = await load_around(url, o, fault, fresh)
        # The new process counts from 0: what it generated is all after its comeback.
        tokens = _metric(_workers(url)["worker-0"]["url"], "radix_worker_completion_tokens_total")
        report = next((ln.strip() for ln in lines if ln.startswith("worker-0 exited")), "none")
        note = (f"up still running: {up.poll() is None}; it printed: `{report[:90]}…`; "
                f"the new worker-0 then generated {tokens:.0f} tokens" + cut_note(outcomes))  # fmt: skip
        retried = _metric(url, "radix_router_retries_total")
        return Row("worker SIGKILL under up", len(outcomes), sum(x.ok for x in outcomes),
                   retried, rec, note)  # fmt: skip
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def _metric(url: str, name: str, label: str = "") -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


UP_SCENARIOS = {"up_kill": up_kill}


async def sigkill(o: Options) -> Row:
    with sim_cluster(o.workers, SPEC) as cluster:
        cluster.start_router()

        async def fault() -> tuple[float, str]:
            cluster.workers["w0"].signal(signal.SIGKILL)
            return await poll(lambda: "w0" not in cluster.router_workers(), 30), "w0 killed (-9)"

        outcomes, rec, note = await with_load(cluster, o, fault)
        return row("worker SIGKILL", cluster, outcomes, rec, note)


async def restart(o: Options) -> Row:
    with sim_cluster(o.workers, SPEC) as cluster:
        cluster.start_router()

        async def fault() -> tuple[float, str]:
            epoch = cluster.router_workers()["w0"]["epoch"]
            start = time.monotonic()
            await asyncio.to_thread(cluster.restart_worker, "w0")

            def back() -> bool:
                w0 = cluster.router_workers().get("w0")
                return w0 is not None and w0["epoch"] != epoch and w0["breaker"] == "closed"

            await poll(back, 30)
            tree = cluster.router_workers()["w0"]["tree"].get("tree_chars", 0)
            return time.monotonic() - start, f"new epoch seen; w0 tree then {tree} chars"

        outcomes, rec, note = await with_load(cluster, o, fault)
        return row("worker restart", cluster, outcomes, rec, note)


async def redis_outage(o: Options) -> Row:
    with sim_cluster(o.workers, SPEC) as cluster:
        cluster.start_router({"reconnect_grace": 5.0})
        assert cluster.redis is not None
        redis = cluster.redis

        async def fault() -> tuple[float, str]:
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(o.redis_outage_s)
            kept = len(cluster.router_workers())
            await asyncio.to_thread(redis.start)
            client = redis_sync.Redis.from_url(redis.url, socket_timeout=2)
            keys = [f"radixrouter:worker:w{i}" for i in range(o.workers)]
            rec = await poll(lambda: client.exists(*keys) == len(keys), 60)
            client.close()
            return rec, f"Redis down {o.redis_outage_s:.0f}s; router kept {kept} workers"

        outcomes, rec, note = await with_load(cluster, o, fault)
        return row("Redis outage", cluster, outcomes, rec, note)


async def hung(o: Options) -> Row:
    held: list[asyncio.StreamWriter] = []
    port = free_port()
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", port)  # type: ignore[arg-type,return-value]
    try:
        with sim_cluster(o.workers, SPEC) as cluster:
            settings = {"admin_key": ADMIN_KEY, "request_timeout": 2.0, "breaker_failures": 3}
            cluster.start_router(settings)

            async def fault() -> tuple[float, str]:
                body = {"url": f"http://127.0.0.1:{port}", "worker_id": "hung"}
                headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
                status, _ = await asyncio.to_thread(
                    http_json, cluster.router.url + "/workers", "POST", body, headers
                )  # type: ignore[union-attr]
                assert status == 201, status
                rec = await poll(lambda: cluster.router_workers()["hung"]["breaker"] == "open", 60)
                fails = cluster.router_workers()["hung"]["failures_total"]
                return rec, f"timeout 2 s; {fails} attempts timed out before the breaker opened"

            # Fresh prefixes: no tree matches them, so the idle hung worker gets picked
            # (with shared prefixes the cache-aware rule never sends it anything).
            def fresh(i: int) -> dict[str, Any]:
                return {"prompt": f"{i} fresh text " * 10, "max_tokens": o.tokens}

            outcomes, rec, note = await with_load(cluster, o, fault, fresh)
            return row("hung worker", cluster, outcomes, rec, note)
    finally:
        for w in held:
            w.close()
        server.close()


async def router_sigterm(o: Options) -> Row:
    with sim_cluster(o.workers, SPEC) as cluster:
        router = cluster.start_router({"drain_timeout": 30.0})
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--before-s", type=float, default=5.0, help="load before the fault")
    p.add_argument("--after-s", type=float, default=5.0, help="load after recovery")
    p.add_argument("--redis-outage-s", type=float, default=30.0)
    p.add_argument("--tokens", type=int, default=40, help="max_tokens per request")
    p.add_argument("--slow-clients", type=int, default=16, help="slowloris connections")
    p.add_argument("--only", default=",".join(scenarios()))


def main(args: argparse.Namespace) -> int:
    o = Options(args.workers, args.concurrency, args.before_s, args.after_s,
                args.redis_outage_s, args.tokens, args.slow_clients)  # fmt: skip
    print("| fault | sent | succeeded | failed | retried | time to recover (s) | notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = asyncio.run(run(args.only.split(","), o))
    return 0 if all(r.ok == r.sent for r in rows) else 1
