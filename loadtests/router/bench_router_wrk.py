"""Router throughput under wrk and streamed time to first token, side by side in one run
(and `upstream-reuse`, UPSTREAM_REUSE below: the price of a worker that does not echo
request ids):
straight to a sim worker (zero cost unless `--prefill-us` / `--decode-ms`), through our router with 1 and with N processes
(`serve --processes N`, replica sync through an embedded Redis; with `--unsynced` also N
without Redis, so without sync: the sync's own price), and through SGLang's
Rust router (`sglang-router`, from its own venv) when its Python is given.

    python -m loadtests router-wrk [--seconds 8] [--connections 64] [--processes 2] \\
        [--sglang-python /work/venv-sglang/bin/python] [--ttft-requests 200] [--rate 300] \\
        [--before-ref main] [--upstream-client aiohttp] [--rounds 3] [--worker zero] [--unsynced] \\
        [--floor] [--aiohttp-server]

`--before-ref REF` adds the router at REF (checked out into a temporary worktree,
`loadtests/kit.py`) as one more target, x1 and xN (its replicas on their own Redis key
prefix), so a change's price is measured side by side;
`--upstream-client aiohttp` adds a router on aiohttp's client (router/upstream/transport.py).
`--worker zero` puts `loadtests/router/zero_worker.py` (a few microseconds a request, echoing
`x-request-id`) behind the routers instead of the sim worker (~0.5 ms of CPU a request,
which on 2 cores sets the pace of every target); `--rounds N` repeats each target's run
N times, the order flipped every round, and prints medians and ratios to sglang-router.

`--aiohttp-server` adds a router x1 with `fast_hot_paths` off: aiohttp's server for every
request, where the router's own protocol (router/http/fast_server.py, on by default)
serves the simplest inference requests. `--floor` adds three floors (`FLOORS`, below).
Two servers route nothing and answer every POST with the zero-cost worker's fixed
completion: aiohttp's low-level `web.Server` (its protocol, C parser, request and
response objects: the server layer the router runs on) and a bare `asyncio.Protocol`
with httptools' parser on uvloop (what a hand-written server for the hot routes would
cost at least); their difference over router x1 is what taking aiohttp's server out of
the hot routes could save at most. The third is a proxy that decides nothing: each
request forwarded to the worker on a kept connection and its answer relayed, in
callbacks (two `asyncio.Protocol`s, httptools' parsers, no task, no coroutine), the
least any Python router on uvloop pays for the same two loopback round trips: router
x1's CPU over it is what the router's own Python costs. Each floor runs twice: as fast as it goes, and offered the router x1's last req/s (wrk's
`delay()`, as `--rate`): a server's CPU a request falls as its rate rises (more
requests a loop wake-up), so the paced pair is the one to hold against the router.

Per target: wrk (a C load generator: Debian's `wrk`) with `--connections` keep-alive
connections POSTs one 1,800-char completion (`max_tokens` 4) for `--seconds`, after a
1 s warm-up; it reports requests/s and latency p50/p99. Router CPU per request is the
utime+stime of the router's whole process tree over the measured run divided by the
requests wrk completed: unlike latency, contention from other jobs on the machine does
not inflate it. Non-2xx answers are counted and reported (they must be 0). `--rate R`
holds the offered load near R requests/s instead of as fast as possible (each
connection waits `connections / R` s after each answer, wrk's `delay()` hook; no wrk2
here), for latency below saturation; wrk's latency excludes that wait.

Streamed TTFT: `--ttft-requests` streamed requests per target, `--ttft-concurrency` at a
time, the targets interleaved (drift hits all alike), time from sending to the first
body byte, with a Python aiohttp client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtests.kit import Command, checkout, cpu_seconds
from loadtests.load.cluster import ROOT, Child, serve, serve_router, wait_health
from loadtests.router import zero_worker
from shared.procs import free_port
from shared.redis_server import RedisServer

SYSTEM = "You are a helpful assistant. Answer briefly. " * 40  # 1,800 chars
BODY = json.dumps({"model": "sim", "prompt": SYSTEM + " question 1", "max_tokens": 4})
LUA = "\n".join(
    [
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        f"wrk.body = '{BODY}'",
        "",
    ]
)


@dataclass
class Target:
    name: str
    url: str
    child: Child | None = None  # None: the worker itself (direct)
    paced: bool = False  # offered the router x1's last req/s (the server floors)


def lua(rate: float, connections: int) -> str:
    """The wrk script: one POST, paced to about `rate` req/s in all when `rate` > 0."""
    if rate <= 0:
        return LUA
    return LUA + f"function delay()\n  return {connections / rate * 1e3:.3f}\nend\n"


def wrk(url: str, seconds: float, connections: int, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        assert m, out
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return {"rps": rps, "p50": ms("50%"), "p99": ms("99%"), "done": done,
            "non2xx": int(bad.group(1)) if bad else 0}  # fmt: skip


async def ttfb(session: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {"model": "sim", "prompt": SYSTEM + f" question {i}", "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        await r.content.readany()
        elapsed = time.perf_counter() - start
        await r.read()
    return elapsed


async def streamed(targets: list[Target], n: int, concurrency: int) -> dict[str, list[float]]:
    """TTFB of `n` streamed requests per target, `concurrency` at a time. At 1 the targets
    alternate request by request; above, round by round (each round `concurrency`
    requests per target, the order reversed every round), so drift hits all alike."""
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        rounds = (n + concurrency - 1) // concurrency
        warm = max(1, 20 // concurrency)
        for r in range(rounds + warm):
            order = targets if r % 2 else targets[::-1]
            for t in order:
                base = r * concurrency
                values = await asyncio.gather(
                    *(ttfb(session, t.url, base + k) for k in range(concurrency))
                )
                if r >= warm:  # warm-up: connections, trees, caches
                    out[t.name].extend(values)
    return out


def start_targets(
    args: argparse.Namespace, tmp: Path, worker_url: str, redis_url: str, before: Path | None
) -> list[Target]:
    targets = [Target("direct", worker_url)]

    def router(
        name: str, n: int, tree: Path = ROOT, env: dict | None = None, sync: bool = True
    ) -> None:
        flags = ["--worker-url", worker_url]
        if n > 1:
            flags += ["--processes", str(n)]
        if n > 1 and sync:  # replicas share decisions and loads through Redis
            flags += ["--redis-url", redis_url]
        child = serve_router(f"{len(targets)}", free_port(), tmp, flags, tree, env, wait=False)
        targets.append(Target(name, child.url, child))

    if before is not None:
        router(f"router x1 @{args.before_ref}", 1, before)
        if args.processes > 1:  # its replicas on their own stream: no one reads across
            env = {"RADIX_ROUTER_REDIS_PREFIX": "before:"}
            router(f"router x{args.processes} @{args.before_ref}", args.processes, before, env)
    for n in sorted({1, args.processes}):
        router(f"router x{n}", n)
    if args.unsynced and args.processes > 1:
        router(f"router x{args.processes}, no sync", args.processes, sync=False)
    for client in args.upstream_clients:
        router(f"router x1 ({client} client)", 1, env={"RADIX_ROUTER_UPSTREAM_CLIENT": client})
    if args.aiohttp_server:
        router("router x1, aiohttp server", 1, env={"RADIX_ROUTER_FAST_HOT_PATHS": "false"})
    if args.floor:
        for kind in FLOORS:
            port = free_port()
            child = serve(f"floor-{kind}", [__name__, "--floor", kind, str(port), worker_url],
                          port, tmp, wait=False)  # fmt: skip
            targets.append(Target(f"floor: {kind}", child.url, child))
            targets.append(Target(f"floor: {kind}, router's rate", child.url, child, paced=True))
    if args.sglang_python:
        port = free_port()
        # Its metrics on a free port too (its default, 29000, is taken by any other
        # sglang-router on the machine, and it then exits at start).
        cmd = ["sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", worker_url, "--policy", "cache_aware", "--log-level", "warn",
               "--prometheus-port", str(free_port())]  # fmt: skip
        child = serve("sglang", cmd, port, tmp, python=args.sglang_python, wait=False)
        targets.append(Target("sglang-router", child.url, child))
    for t in targets:
        if t.child is not None:
            wait_health(t.child, 90)
    return targets


def summarize(rounds: dict[str, list[tuple[float, float]]]) -> None:
    """Medians over rounds, and each target's ratios to sglang-router's where it ran."""
    ref = rounds.get("sglang-router")
    floor_line(rounds)
    print(
        "\n| target | req/s, median | CPU ms / request, median | req/s / sglang-router | CPU / sglang-router |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, values in rounds.items():
        rps = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        if ref and name not in ("direct", "sglang-router"):
            ref_rps = statistics.median(v[0] for v in ref)
            ref_cpu = statistics.median(v[1] for v in ref)
            vs = f"{rps / ref_rps:.2f}x | {cpu / ref_cpu:.2f}x"
        else:
            vs = " | "
        print(f"| {name} | {rps:.0f} | {cpu:.3f} | {vs} |")


def floor_line(rounds: dict[str, list[tuple[float, float]]]) -> None:
    """With `--floor`: the server layer's share of the router's CPU, and the router's own
    Python over a proxy that decides nothing, from the medians."""
    if "router x1" not in rounds or "floor: aiohttp" not in rounds:
        return
    router = statistics.median(v[1] for v in rounds["router x1"])
    for how in ("", ", router's rate"):
        aio, bare, proxy = (
            statistics.median(v[1] for v in rounds[f"floor: {k}{how}"]) for k in FLOORS
        )
        print(f"\nproxy floor{how or ', as fast as it goes'}: {proxy:.3f} ms a request; router "
              f"x1 {router:.3f} ms is {router / proxy:.1f}x it ({router - proxy:.3f} ms its own)")  # fmt: skip
        print(f"server layer{how or ', as fast as each goes'}: aiohttp {aio:.3f} - httptools "
              f"{bare:.3f} = {aio - bare:.3f} ms a request (what the router's own protocol saves "
              f"on the hot routes, router/http/fast_server.py; {(aio - bare) / router:.0%} of "
              f"router x1's {router:.3f} ms)")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=8.0, help="wrk run per target, seconds")
    p.add_argument("--rounds", type=int, default=1, help="wrk runs per target, order alternating")
    p.add_argument(
        "--worker", choices=["sim", "zero"], default="sim",
        help="sim: our sim worker; zero: loadtests/router/zero_worker.py (no streams: TTFT skipped)",
    )  # fmt: skip
    p.add_argument("--connections", type=int, default=64, help="wrk keep-alive connections")
    p.add_argument(
        "--rate", type=float, default=0.0, help="offered req/s per target (0: as fast as it goes)"
    )
    p.add_argument("--processes", type=int, default=2, help="router processes of the second run")
    p.add_argument(
        "--aiohttp-server", action="store_true",
        help="also a router x1 with fast_hot_paths off (aiohttp's server for every request)",
    )  # fmt: skip
    p.add_argument(
        "--floor", action="store_true",
        help="also the server floors: aiohttp's low-level server and asyncio + httptools, fixed answer",
    )  # fmt: skip
    p.add_argument(
        "--unsynced", action="store_true",
        help="also N processes without Redis (no replica sync): what the sync itself costs",
    )  # fmt: skip
    p.add_argument(
        "--sglang-python",
        default=None,
        help="a Python with sglang-router installed (default: none)",
    )
    p.add_argument("--ttft-requests", type=int, default=200, help="streamed requests per target")
    p.add_argument("--ttft-concurrency", type=int, default=1, help="streamed requests at a time")
    p.add_argument(
        "--prefill-us", type=float, default=0.0, help="the sim worker's prefill cost per token"
    )
    p.add_argument("--decode-ms", type=float, default=0.0, help="the sim worker's decode cost")
    p.add_argument(
        "--before-ref",
        default=None,
        help="also run the router at this git ref (a temporary worktree), side by side",
    )
    p.add_argument(
        "--upstream-client",
        dest="upstream_clients",
        action="append",
        default=[],
        choices=["own", "aiohttp"],
        help="also run a router with this upstream_client (repeatable)",
    )


def main(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install -y wrk)")
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as d:
        tmp = Path(d)
        script = tmp / "post.lua"
        script.write_text(lua(args.rate, args.connections))
        wport = free_port()
        if args.worker == "zero":  # next to no cost: the routers, not it, set the pace
            worker = serve("w", [zero_worker.__name__, str(wport)], wport, tmp)
        else:
            worker = serve("w", ["worker", "serve", "--engine", "sim", "--host", "127.0.0.1",
                                 "--port", str(wport), "--log-level", "WARNING",
                                 "--sim-prefill-us-per-token", str(args.prefill_us),
                                 "--sim-decode-ms-per-token", str(args.decode_ms)], wport, tmp)  # fmt: skip
        redis = RedisServer().start()
        targets: list[Target] = []
        stack = contextlib.ExitStack()
        try:
            before = stack.enter_context(checkout(args.before_ref)) if args.before_ref else None
            targets = start_targets(args, tmp, worker.url, redis.url, before)
            print("| round | target | req/s | p50 (ms) | p99 (ms) | CPU ms / request | non-2xx |")
            print("|---:|---|---:|---:|---:|---:|---:|")
            paced = tmp / "paced.lua"
            router_rps = 0.0
            for t in targets:
                r = wrk(t.url + "/v1/completions", 1, args.connections, script)  # warm-up
                router_rps = r["rps"] if t.name == "router x1" else router_rps
            rounds: dict[str, list[tuple[float, float]]] = {t.name: [] for t in targets}
            for n in range(args.rounds):
                # The order flips every round, so drift on a shared machine hits all alike.
                for t in targets if n % 2 == 0 else targets[::-1]:
                    pid = (t.child or worker).pid
                    # A paced floor is offered what the router x1 last carried: CPU a
                    # request falls as a server's rate rises (more requests a wake-up).
                    paced.write_text(lua(router_rps, args.connections))
                    cpu0 = cpu_seconds(pid, descendants=True)
                    r = wrk(t.url + "/v1/completions", args.seconds, args.connections,
                            paced if t.paced else script)  # fmt: skip
                    cpu = (cpu_seconds(pid, descendants=True) - cpu0) * 1e3 / max(1, r["done"])
                    rounds[t.name].append((r["rps"], cpu))
                    router_rps = r["rps"] if t.name == "router x1" else router_rps
                    print(f"| {n + 1} | {t.name} | {r['rps']:.0f} | {r['p50']:.1f} | "
                          f"{r['p99']:.1f} | {cpu:.3f} | {r['non2xx']} |", flush=True)  # fmt: skip
            print("\n(direct: the CPU column is the worker's own)")
            summarize(rounds)
            if args.worker == "zero":
                return 0  # it answers no streams
            ttft = asyncio.run(streamed(targets, args.ttft_requests, args.ttft_concurrency))
            base = statistics.median(ttft["direct"])
            print(f"\nstreamed, {args.ttft_concurrency} at a time")
            print("\n| target | streamed TTFT p50 (ms) | p99 (ms) | p50 / direct |")
            print("|---|---:|---:|---:|")
            for name, values in ttft.items():
                values.sort()
                p50, p99 = statistics.median(values), values[int(0.99 * (len(values) - 1))]
                print(f"| {name} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {p50 / base:.2f}x |")
            print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        finally:
            for t in targets:
                if t.child is not None:
                    t.child.stop(grace_s=15)
            worker.stop(grace_s=15)
            redis.stop()
            stack.close()
    return 0


# -- upstream-reuse ---------------------------------------------------------------------
def opened(router_url: str) -> int:
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^radix_router_upstream_connections_opened_total (\S+)", text, re.M)
    return int(float(found[1])) if found else -1


def reuse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=8.0, help="wrk run per target, seconds")
    p.add_argument("--connections", type=int, default=32, help="wrk keep-alive connections")


def reuse_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-reuse-") as d:
        tmp = Path(d)
        script = tmp / "post.lua"
        script.write_text(LUA)
        children: list[Child] = []
        try:
            rows = []
            for mode in ("echo", "no-echo"):
                wport, rport = free_port(), free_port()
                echo = [] if mode == "echo" else ["--no-echo"]
                worker = serve(f"{mode}-w", [zero_worker.__name__, str(wport), *echo], wport, tmp)
                children.append(worker)
                router = serve_router(f"{mode}-r", rport, tmp, ["--worker-url", worker.url])
                children.append(router)
                rows.append((mode, router.url, router.pid))
            print(
                "| worker | req/s | p50 (ms) | p99 (ms) | router CPU ms / request | connections opened / request | non-2xx |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|")
            for mode, url, pid in rows:
                wrk(url + "/v1/completions", 1, args.connections, script)  # warm-up
                before_conns, cpu0 = opened(url), cpu_seconds(pid, descendants=True)
                r = wrk(url + "/v1/completions", args.seconds, args.connections, script)
                cpu = (cpu_seconds(pid, descendants=True) - cpu0) * 1e3 / max(1, r["done"])
                conns = (opened(url) - before_conns) / max(1, r["done"])
                print(f"| {mode} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {cpu:.3f} | "
                      f"{conns:.2f} | {r['non2xx']} |", flush=True)  # fmt: skip
        finally:
            for child in children:
                child.stop(grace_s=15)
    return 0


UPSTREAM_REUSE = Command(
    """What the upstream reuse rule costs when a worker does not echo request ids.

    python -m loadtests upstream-reuse [--seconds 8] [--connections 32]

The router reuses a keep-alive connection to a worker only after an answer that echoed
its `x-request-id` (router/upstream/transport.py): the project's worker echoes, a stock
engine may not, and then each request gets a fresh connection. Two zero-cost workers
(loadtests/router/zero_worker.py) that answer a fixed completion at once, one echoing
the id and one not (`--no-echo`), each behind its own router (one process, the own client), side by side under wrk: req/s,
the router's CPU per request (utime+stime of its process / requests) and the upstream
connections it opened (`radix_router_upstream_connections_opened_total`).
""",
    reuse_arguments,
    reuse_main,
)


# -- router-profile ---------------------------------------------------------------------
# Run in the profiled process with `python -c`, from the tree under test (so the code of a
# `--before-ref` is the one profiled): a router app on uvloop in process, fronting the
# worker argv[1], CPU-time cProfile while the parent's wrk runs, then shares per layer.
_PROFILED = """
import asyncio, cProfile, json, sys, time
import uvloop
from aiohttp import web
from router.http.app import create_app
from shared.config import RouterConfig
from shared.procs import free_port
from shared.serving.gc_policy import freeze_startup, tune_for_serving

async def main():
    fast = {"fast_hot_paths": False} if sys.argv[2] == "aiohttp" else {}
    config = RouterConfig(worker_urls=(sys.argv[1],), access_log=False, **fast)
    app = create_app(config)
    port = free_port()
    try:  # as serve() serves it, where the tree has it
        from router.http.app import serving_protocol, serving_runner
        from shared.serving.http_server import bind
        runner = await serving_runner(app)
        protocol = serving_protocol(runner, config)
        await bind(runner, "127.0.0.1", port, header_read_timeout=10, protocol=protocol)
    except ImportError:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            from router.http.edge import install_hot_paths
            from router.http.state import EDGE
            install_hot_paths(runner, app[EDGE])
        except ImportError:
            pass
        await web.TCPSite(runner, "127.0.0.1", port).start()
    freeze_startup()
    tune_for_serving()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # the warm-up is done
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    await loop.run_in_executor(None, sys.stdin.readline)  # the measured run is done
    profile.disable()
    profile.create_stats()
    out = {}
    for (path, _line, name), (_cc, _nc, own, _cum, _callers) in profile.stats.items():
        out[path + ":" + name] = out.get(path + ":" + name, 0.0) + own
    print(json.dumps(out), flush=True)
    await runner.cleanup()

uvloop.run(main())
"""
# Layers of the router, by where a function lives (the first that matches): shares of
# the CPU the profile saw (wrk and the worker are other processes).
LAYERS = (
    ("fast server", ("router/http/fast_server", "router/http/fast_answer")),
    ("aiohttp server", ("aiohttp/web_", "aiohttp/http_", "aiohttp/streams", "aiohttp/base_protocol",
                        "aiohttp/helpers", "aiosignal", "multidict", "yarl")),
    ("upstream client", ("router/upstream/connection", "router/upstream/pool",
                         "router/upstream/transport", "router/upstream/echo")),
    ("proxy", ("router/upstream/proxy", "router/upstream/answers", "router/upstream/responder")),
    ("edge + handlers", ("router/http/", "shared/serving/access_log", "shared/serving/errors",
                         "shared/serving/http.py")),
    ("policy + holdings", ("router/policy", "router/holdings", "router/routing")),
    ("fleet table", ("router/fleet",)),
    ("fleet queue", ("router/queue",)),
    ("metrics", ("metrics", "prometheus")),
    ("body + JSON", ("shared/serving/body", "json_codec", "orjson", "json/")),
    ("request model", ("pydantic", "shared/wire")),
    ("event loop", ("asyncio", "uvloop")),
    ("builtins", ("~",)),
)  # fmt: skip


def layer_of(where: str) -> str:
    return next((name for name, parts in LAYERS if any(p in where for p in parts)), "other")


def profile_tree(
    tree: Path, worker_url: str, args: argparse.Namespace, script: Path, aiohttp: bool = False
) -> dict:
    """Per layer: CPU seconds of one profiled run of the router at `tree` under wrk."""
    child = subprocess.Popen(
        [sys.executable, "-c", _PROFILED, worker_url, "aiohttp" if aiohttp else "-"], cwd=tree, text=True,
        env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        url = f"http://127.0.0.1:{child.stdout.readline().strip()}/v1/completions"
        wrk(url, 1, args.connections, script)
        child.stdin.write("\n")
        child.stdin.flush()
        done = wrk(url, args.seconds, args.connections, script)["done"]
        child.stdin.write("\n")
        child.stdin.flush()
        own = json.loads(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    layers: dict[str, float] = {}
    for where, seconds in own.items():
        layers[layer_of(where)] = layers.get(layer_of(where), 0.0) + seconds
    return {"requests": done, "layers": layers}


def profile_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        script = tmp / "post.lua"
        script.write_text(LUA)
        wport = free_port()
        worker = serve("w", [zero_worker.__name__, str(wport)], wport, tmp)
        stack.callback(worker.stop, grace_s=15)
        trees = {"this tree": ROOT}
        if args.before_ref:
            trees = {f"@{args.before_ref}": stack.enter_context(checkout(args.before_ref)), **trees}
        seen = {name: profile_tree(tree, worker.url, args, script) for name, tree in trees.items()}
        if args.aiohttp_server:
            seen["aiohttp server"] = profile_tree(ROOT, worker.url, args, script, aiohttp=True)
    names = list(seen)
    print("| layer | " + " | ".join(f"{n}: share | {n}: us / request" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    first = seen[names[0]]["layers"]
    every = {layer for n in names for layer in seen[n]["layers"]}  # a layer one tree lacks too
    for layer in sorted(every, key=lambda k: -first.get(k, 0.0)):
        cells = []
        for n in names:
            total = sum(seen[n]["layers"].values())
            value = seen[n]["layers"].get(layer, 0.0)
            cells.append(f"{100 * value / total:.1f}% | {value / seen[n]['requests'] * 1e6:.0f}")
        print(f"| {layer} | " + " | ".join(cells) + " |")
    totals = [sum(seen[n]["layers"].values()) / seen[n]["requests"] * 1e6 for n in names]
    print("| all (profiled: cProfile's own cost included) | "
          + " | ".join(f"100% | {t:.0f}" for t in totals) + " |")  # fmt: skip
    return 0


def profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=4.0, help="the profiled wrk run, seconds")
    p.add_argument("--connections", type=int, default=32, help="wrk keep-alive connections")
    p.add_argument("--before-ref", default=None, help="also profile the router at this git ref")
    p.add_argument(
        "--aiohttp-server", action="store_true", help="also this tree with fast_hot_paths off"
    )


ROUTER_PROFILE = Command(
    """Where the router's CPU goes, per layer, under wrk (a cProfile with a CPU-time clock).

    python -m loadtests router-profile [--before-ref main] [--seconds 4] [--connections 32] [--aiohttp-server]

A router app (`create_app`, on uvloop, served as `serve()` serves it: the hot paths of
router/http/edge.py installed where the tree has them, start-up frozen out of the
garbage collector) runs in a child process in front of the zero-cost worker
(loadtests/router/zero_worker.py); wrk POSTs one completion for `--seconds` while the
child profiles itself with `cProfile.Profile(time.process_time)` (a wall clock put 25-40%
in socket writes: the process waiting for the kernel, not its CPU). Each function's own
time is summed into the router's layers (`LAYERS`, by file). With `--before-ref REF` the
router at REF (a temporary worktree) is profiled first, the same way; with
`--aiohttp-server` this tree again with `fast_hot_paths` off (router/http/fast_server.py
not in front). Absolute figures
include cProfile's own cost (about 4x); the shares are what to compare.
""",
    profile_arguments,
    profile_main,
)


# -- server floors (`router-wrk --floor`) ----------------------------------------------
# Each answers every POST with the zero-cost worker's completion and every GET (/health)
# with its small info object, keep-alive, on uvloop: nothing but the HTTP server layer.
def _fixed(method: str) -> bytes:
    return zero_worker.COMPLETION if method == "POST" else zero_worker.INFO


async def _aiohttp_floor(port: int, worker_url: str) -> None:
    """aiohttp's low-level server: its protocol, parser, Request and Response objects."""
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.Response(body=_fixed(request.method), content_type="application/json")

    runner = web.ServerRunner(web.Server(handler), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


class _HttptoolsFloor(asyncio.Protocol):
    """An asyncio.Protocol with httptools' request parser: the least a Python server does."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            self.transport.close()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        body = _fixed(self.parser.get_method().decode())
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        if not self.parser.should_keep_alive():
            self.transport.close()  # type: ignore[union-attr]


async def _httptools_floor(port: int, worker_url: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_HttptoolsFloor, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


class _ProxyUpstream(asyncio.Protocol):
    """The proxy floor's kept connection to the worker: relays each answer's body."""

    def __init__(self, idle: list[_ProxyUpstream]) -> None:
        import httptools

        self.idle, self.parser = idle, httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: _ProxyFloor | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        client, self.client = self.client, None
        self.idle.append(self)
        if client is not None:
            client.relay(body)


class _ProxyFloor(_HttptoolsFloor):
    """A proxy that decides nothing: each POST goes to the worker on a kept connection
    and the worker's answer goes back, all in callbacks; GETs are answered here."""

    def __init__(self, worker: tuple[str, int], idle: list[_ProxyUpstream]) -> None:
        super().__init__()
        self.worker, self.idle = worker, idle
        self.body: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_method() != b"POST":
            return super().on_message_complete()
        body, self.body = b"".join(self.body), []
        out = b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n" \
              b"Content-Length: %d\r\n\r\n%s" % (self.worker[0].encode(), self.worker[1], len(body), body)  # fmt: skip
        if self.idle:
            upstream = self.idle.pop()
            upstream.client = self
            upstream.transport.write(out)  # type: ignore[union-attr]
        else:
            asyncio.get_running_loop().create_task(self.connect(out))

    async def connect(self, out: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(lambda: _ProxyUpstream(self.idle), *self.worker)
        upstream.client = self
        upstream.transport.write(out)  # type: ignore[union-attr]

    def relay(self, body: bytes) -> None:
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )


async def _proxy_floor(port: int, worker_url: str) -> None:
    loop = asyncio.get_running_loop()
    address = urllib.parse.urlsplit(worker_url)
    worker, idle = (address.hostname or "127.0.0.1", address.port or 80), []
    server = await loop.create_server(lambda: _ProxyFloor(worker, idle), "127.0.0.1", port,
                                      backlog=1024)  # fmt: skip
    async with server:
        await server.serve_forever()


FLOORS = {"aiohttp": _aiohttp_floor, "httptools": _httptools_floor, "proxy": _proxy_floor}

if __name__ == "__main__":
    # a floor: python -m loadtests.router.bench_router_wrk --floor KIND PORT WORKER_URL
    import uvloop

    _, _, kind, port, worker_url = sys.argv
    uvloop.run(FLOORS[kind](int(port), worker_url))
