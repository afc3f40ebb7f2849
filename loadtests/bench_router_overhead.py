"""Router overhead: the same requests straight to a zero-cost sim worker and through the
router, side by side in one run.

    python -m loadtests router-overhead [--requests 600] [--concurrency 32] [--seconds 8] \\
        [--before-ref main]

Processes: a Redis-free sim worker (prefill and decode cost 0), the router
(`python -m router serve --worker-url ...`, the default cache_aware policy), and this
client. Latency is measured at concurrency 1 with direct and routed requests
interleaved (so drift hits both alike); throughput is a closed loop of `--concurrency`
clients for `--seconds` each way. Streamed time to first byte is measured the same way.
`--before-ref REF` adds a router started from REF (a temporary git worktree,
`loadtests/refs.py`), interleaved with the others: the change's price side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from loadtests.options import HelpFormatter
from loadtests.refs import checkout
from shared.procs import answers_health, wait_until
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]

SYSTEM = "You are a helpful assistant. Answer briefly. " * 40


def body(i: int, stream: bool = False) -> dict:
    return {"prompt": SYSTEM + f"question {i}", "max_tokens": 4, "stream": stream}


def spawn(args: list[str], port: int, tree: Path = ROOT) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], env=env, cwd=tree,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: proc.poll() is not None or answers_health(url), 60, poll_s=0.1)
    if proc.poll() is None and answers_health(url):
        return proc
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process: its CPU cost, whatever else competes for the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(session: aiohttp.ClientSession, url: str, payload: dict) -> float:
    start = time.perf_counter()
    async with session.post(url, json=payload) as r:
        if payload["stream"]:
            await r.content.readany()  # first byte
            elapsed = time.perf_counter() - start
            await r.read()
            return elapsed
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - start


async def latency(
    session: aiohttp.ClientSession, urls: dict[str, str], n: int, stream: bool
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in urls}
    order = list(urls.items())
    for i in range(n):
        for name, url in order if i % 2 else order[::-1]:
            out[name].append(await one(session, url + "/v1/completions", body(i, stream)))
    return out


async def throughput(
    session: aiohttp.ClientSession, url: str, concurrency: int, seconds: float, pids: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """Requests/s, and CPU ms per request of each process in `pids`."""
    done = 0
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    end = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < end:
            await one(session, url + "/v1/completions", body(i))
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    rate = done / (time.perf_counter() - start)
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) * 1000 / done for name, pid in pids.items()}
    return rate, cpu


async def bench(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> None:
    """`urls`: "direct", "router" and maybe a before-ref router; `pids` each process's."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await latency(session, urls, 50, False)  # warm up every path
        lat = await latency(session, urls, args.requests, False)
        ttfb = await latency(session, urls, args.requests // 3, True)
        rps: dict[str, float] = {}
        cpu: dict[str, dict[str, float]] = {}
        for name, url in urls.items():
            rps[name], cpu[name] = await throughput(
                session, url, args.concurrency, args.seconds, pids
            )
    ms = 1000.0
    routers = [name for name in urls if name != "direct"]
    print(f"\nRouter overhead, {args.requests} requests at concurrency 1 (interleaved), "
          f"{args.concurrency} concurrent for {args.seconds}s, on {os.cpu_count()} cores\n")  # fmt: skip
    print("| metric | direct | " + " | ".join(f"through {r}" for r in routers) + " |")
    print("|---|---|" + "---|" * len(routers))
    for label, data in (("latency", lat), ("stream first byte", ttfb)):
        for q, qname in ((0.5, "p50"), (0.99, "p99")):
            d = pct(data["direct"], q) * ms
            cells = [
                f"{pct(data[r], q) * ms:.3f} ({pct(data[r], q) * ms / d:.2f}x)" for r in routers
            ]
            print(f"| {label} {qname} (ms) | {d:.3f} | " + " | ".join(cells) + " |")
    print(f"| max requests/s | {rps['direct']:.0f} | "
          + " | ".join(f"{rps[r]:.0f} ({rps[r] / rps['direct']:.2f}x)" for r in routers) + " |")  # fmt: skip
    print("| router CPU ms / request | | "
          + " | ".join(f"{cpu[r][r]:.3f}" for r in routers) + " |")  # fmt: skip
    print(f"\n(load average {os.getloadavg()[0]:.1f}; worker CPU ms / routed request: "
          + ", ".join(f"{r} {cpu[r]['worker']:.3f}" for r in routers) + ")")  # fmt: skip
    added = (pct(lat["router"], 0.5) - pct(lat["direct"], 0.5)) * ms
    print(f"\np50 overhead {added:.3f} ms (target <= 1 ms): {'met' if added <= 1.0 else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument(
        "--before-ref", default=None, help="also measure the router at this git ref, side by side"
    )
    args = parser.parse_args(argv)
    wport = free_port()
    worker = spawn(["worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(wport),
                    "--worker-id", "bench", "--log-level", "WARNING"], wport)  # fmt: skip
    routers: list[subprocess.Popen[bytes]] = []
    urls = {"direct": f"http://127.0.0.1:{wport}"}
    pids = {"worker": worker.pid}
    with contextlib.ExitStack() as stack:
        trees = {"router": ROOT}
        if args.before_ref:
            trees[f"router @{args.before_ref}"] = stack.enter_context(checkout(args.before_ref))
        try:
            for name, tree in trees.items():
                rport = free_port()
                router = spawn(["router", "serve", "--host", "127.0.0.1", "--port", str(rport),
                                "--policy", args.policy, "--worker-url", urls["direct"],
                                "--log-level", "WARNING"], rport, tree)  # fmt: skip
                routers.append(router)
                urls[name] = f"http://127.0.0.1:{rport}"
                pids[name] = router.pid
            asyncio.run(bench(args, urls, pids))
        finally:
            for proc in (*routers, worker):
                proc.terminate()
                proc.wait(10)
