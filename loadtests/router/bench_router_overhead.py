"""Router overhead: the same requests straight to a zero-cost sim worker and through the
router, side by side in one run.

    python -m loadtests router-overhead [--requests 600] [--concurrency 32] [--seconds 8]
    python -m loadtests router-overhead --before-ref REF [--rounds 4]

Processes: a Redis-free sim worker (prefill and decode cost 0), the router
(`python -m router serve --worker-url ...`, the default cache_aware policy), and this
client. Latency is measured at concurrency 1 with direct and routed requests
interleaved (so drift hits both alike); throughput is a closed loop of `--concurrency`
clients for `--seconds` each way. Streamed time to first byte is measured the same way.

`--before-ref REF`: the router's CPU per request at git commit REF against this tree's,
side by side in one run: REF's files are checked out into a temporary folder, both
routers front the same worker, and `--rounds` closed-loop rounds alternate between them
(so drift on a shared machine hits both alike). CPU is each router process's own
utime + stime over the requests it served.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from loadtests.options import HelpFormatter
from shared.procs import answers_health, wait_until
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]

SYSTEM = "You are a helpful assistant. Answer briefly. " * 40


def body(i: int, stream: bool = False) -> dict:
    return {"prompt": SYSTEM + f"question {i}", "max_tokens": 4, "stream": stream}


def spawn(args: list[str], port: int, root: Path = ROOT) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], env=env, cwd=root, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
    session: aiohttp.ClientSession, direct: str, routed: str, n: int, stream: bool
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(n):
        order = (
            [("direct", direct), ("router", routed)]
            if i % 2
            else [("router", routed), ("direct", direct)]
        )
        for name, url in order:
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


async def bench(args: argparse.Namespace, direct: str, routed: str, pids: dict[str, int]) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await latency(session, direct, routed, 50, False)  # warm up both paths
        lat = await latency(session, direct, routed, args.requests, False)
        ttfb = await latency(session, direct, routed, args.requests // 3, True)
        rps_direct, _ = await throughput(session, direct, args.concurrency, args.seconds, pids)
        rps_router, cpu = await throughput(session, routed, args.concurrency, args.seconds, pids)
        rps = {"direct": rps_direct, "router": rps_router}
    ms = 1000.0
    print(f"\nRouter overhead, {args.requests} requests at concurrency 1 (interleaved), "
          f"{args.concurrency} concurrent for {args.seconds}s, on {os.cpu_count()} cores\n")  # fmt: skip
    print("| metric | direct | through router | added | ratio |")
    print("|---|---|---|---|---|")
    for label, data in (("latency", lat), ("stream first byte", ttfb)):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            d, r = pct(data["direct"], q) * ms, pct(data["router"], q) * ms
            print(f"| {label} {name} (ms) | {d:.3f} | {r:.3f} | {r - d:+.3f} | {r / d:.2f}x |")
    mean_d, mean_r = statistics.mean(lat["direct"]) * ms, statistics.mean(lat["router"]) * ms
    print(
        f"| latency mean (ms) | {mean_d:.3f} | {mean_r:.3f} | {mean_r - mean_d:+.3f} | {mean_r / mean_d:.2f}x |"
    )
    print(
        f"| max requests/s | {rps['direct']:.0f} | {rps['router']:.0f} | | {rps['router'] / rps['direct']:.2f}x |"
    )
    print(f"\nCPU per routed request: router process {cpu['router']:.3f} ms, "
          f"worker process {cpu['worker']:.3f} ms (load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    added = (pct(lat["router"], 0.5) - pct(lat["direct"], 0.5)) * ms
    print(f"\np50 overhead {added:.3f} ms (target <= 1 ms): {'met' if added <= 1.0 else 'NOT met'}")


def checkout(ref: str, into: Path) -> None:
    """REF's tracked files into `into` (git archive: no worktree left behind)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


async def before_after(
    args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]
) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    cpu: dict[str, list[float]] = {name: [] for name in urls}
    rps: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in urls.values():  # warm up both
            for i in range(50):
                await one(session, url + "/v1/completions", body(i))
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                rate, per = await throughput(
                    session, urls[name], args.concurrency, args.seconds, {name: pids[name]}
                )
                cpu[name].append(per[name])
                rps[name].append(rate)
    print(f"\nRouter CPU per request, {args.before_ref} (before) vs this tree (after): "
          f"{args.rounds} alternating rounds of {args.concurrency} concurrent for "
          f"{args.seconds}s, on {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print("| router | CPU ms / request, each round | median | requests/s, median |")
    print("|---|---|---:|---:|")
    for name in urls:
        rounds = ", ".join(f"{c:.3f}" for c in cpu[name])
        print(f"| {name} | {rounds} | {statistics.median(cpu[name]):.3f} | "
              f"{statistics.median(rps[name]):.0f} |")  # fmt: skip
    ratio = statistics.median(cpu["after"]) / statistics.median(cpu["before"])
    print(f"\nafter / before CPU per request: {ratio:.2f}x")


def main_before_after(args: argparse.Namespace) -> None:
    import tempfile

    wport = free_port()
    ports = {"before": free_port(), "after": free_port()}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="router-before-") as tmp:
        checkout(args.before_ref, Path(tmp))
        roots = {"before": Path(tmp), "after": ROOT}
        try:
            procs.append(spawn(["worker", "serve", "--engine", "sim", "--host", "127.0.0.1",
                                "--port", str(wport), "--worker-id", "bench", "--log-level",
                                "WARNING"], wport))  # fmt: skip
            pids = {}
            for name, port in ports.items():
                proc = spawn(["router", "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--policy", args.policy, "--worker-url", f"http://127.0.0.1:{wport}",
                              "--log-level", "WARNING"], port, roots[name])  # fmt: skip
                procs.append(proc)
                pids[name] = proc.pid
            urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
            asyncio.run(before_after(args, urls, pids))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--before-ref", help="git commit to compare this tree's router CPU against")
    parser.add_argument("--rounds", type=int, default=4, help="with --before-ref: rounds each")
    args = parser.parse_args(argv)
    if args.before_ref:
        main_before_after(args)
        return
    wport, rport = free_port(), free_port()
    worker = spawn(["worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(wport),
                    "--worker-id", "bench", "--log-level", "WARNING"], wport)  # fmt: skip
    router = None
    try:
        router = spawn(["router", "serve", "--host", "127.0.0.1", "--port", str(rport), "--policy", args.policy,
                        "--worker-url", f"http://127.0.0.1:{wport}", "--log-level", "WARNING"], rport)  # fmt: skip
        pids = {"router": router.pid, "worker": worker.pid}
        asyncio.run(bench(args, f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{rport}", pids))
    finally:
        for proc in (router, worker):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
