"""Router CPU per request vs fleet size, before and after the maintained routable view,
side by side in one run.

    python -m loadtests router-fleet-size [--sizes 1,64,256,1000] [--seconds 6]
        [--concurrency 16] [--before-ref b102ab7] [--together]

One zero-cost sim worker process listens on 0.0.0.0; the router gets N static workers
`http://127.0.a.b:PORT`, distinct loopback addresses that all reach that one process, so
each is its own worker id (the router's table, breakers, loads and prefix trees see N
workers) while the serving cost stays one cheap process. For each N, a router built
from `--before-ref` (extracted with `git archive` into a temp dir: the code before the
change) and one from this working tree run the same closed loop, in alternating order.
Measured: the router process's utime + stime from /proc over the loop, divided by the
requests it answered. With `--together`, both routers run at the same time, each with its
own closed loop of `--concurrency` clients, so both see the same contention moment by
moment (on a shared machine, runs one after the other differ by ±30% from the load of
the minute alone). Before the loop, `GET /v1/models` lets the router learn every
worker's model (what a registry heartbeat reports), and a warm-up fills the trees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtests.options import HelpFormatter
from loadtests.router.bench_router_overhead import cpu_seconds, pct
from shared.procs import answers_health, wait_until
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]

SYSTEMS = [f"System prompt {k}: you are a careful assistant. " * 30 for k in range(8)]


def loopback(k: int) -> str:
    """The k-th address of 127.0.0.0/8, skipping .0 and .255 (k = 0 is 127.0.0.1)."""
    a, b = divmod(k, 254)
    return f"127.0.{a}.{b + 1}"


def extract(ref: str, into: Path) -> Path:
    """The router and shared packages as they were at `ref` (read-only git: archive)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "router", "shared"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def spawn(args: list[str], port: int, tree: Path = ROOT) -> subprocess.Popen[bytes]:
    """`python -m <args>` with `tree` first on the path; returns once /health answers."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], env=env, cwd=tree,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: proc.poll() is not None or answers_health(url), 120, poll_s=0.1)
    if proc.poll() is None and answers_health(url):
        return proc
    proc.kill()
    raise RuntimeError(f"{args[0]} from {tree} did not start")


def write_config(path: Path, n: int, port: int) -> Path:
    urls = "".join(f"  - http://{loopback(k)}:{port}\n" for k in range(n))
    path.write_text(f"worker_urls:\n{urls}")
    return path


def body(i: int) -> dict:
    return {
        "model": "sim",  # what OpenAI clients always send
        "prompt": SYSTEMS[i % len(SYSTEMS)] + f"question {i}",
        "max_tokens": 4,
    }


async def closed_loop(url: str, concurrency: int, seconds: float, pid: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as r:  # learn each worker's model
            assert r.status == 200, r.status
        for i in range(200):  # warm-up: connections, trees
            async with session.post(url + "/v1/completions", json=body(i)) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
        latencies: list[float] = []
        end = time.perf_counter() + seconds
        cpu_before = cpu_seconds(pid)

        async def loop(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body(i)) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - start)
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds(pid) - cpu_before
    n = len(latencies)
    return {"cpu_us": cpu / n * 1e6, "rps": n / elapsed, "p50_ms": pct(latencies, 0.5) * 1e3}


def start_router(tree: Path, config: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = ["router", "serve", "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]  # fmt: skip
    return spawn(args, port, tree), f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


def run_router(tree: Path, config: Path, concurrency: int, seconds: float) -> dict[str, float]:
    router, url = start_router(tree, config)
    try:
        return asyncio.run(closed_loop(url, concurrency, seconds, router.pid))
    finally:
        stop(router)


def run_together(
    trees: dict[str, Path], config: Path, concurrency: int, seconds: float
) -> dict[str, dict[str, float]]:
    """Every router of `trees` under its own closed loop, all at the same time."""
    started = {name: start_router(tree, config) for name, tree in trees.items()}

    async def both() -> list[dict[str, float]]:
        return await asyncio.gather(
            *(closed_loop(url, concurrency, seconds, proc.pid) for proc, url in started.values())
        )

    try:
        return dict(zip(started, asyncio.run(both()), strict=True))
    finally:
        for proc, _ in started.values():
            stop(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--sizes", default="1,64,256,1000")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--before-ref", default="b102ab7")
    parser.add_argument(
        "--together", action="store_true", help="run before and after at the same time"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    wport = free_port()
    worker = spawn(["worker", "serve", "--engine", "sim", "--host", "0.0.0.0", "--port", str(wport),
                    "--worker-id", "bench", "--log-level", "WARNING"], wport)  # fmt: skip
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            before = extract(args.before_ref, Path(tmp))
            for j, n in enumerate(sizes):
                config = write_config(Path(tmp) / f"fleet{n}.yaml", n, wport)
                order = [("before", before), ("after", ROOT)]
                result = {}
                if args.together:
                    result = run_together(dict(order), config, args.concurrency, args.seconds)
                else:
                    for name, tree in order if j % 2 == 0 else order[::-1]:
                        result[name] = run_router(tree, config, args.concurrency, args.seconds)
                for name, _ in order:
                    print(f"  {n:>5} workers {name:>6}: {result[name]}", flush=True)
                rows.append((n, result["before"], result["after"]))
    finally:
        worker.terminate()
        worker.wait(10)
    print(f"\nRouter CPU per request vs fleet size (closed loop, {args.concurrency} clients, "
          f"{args.seconds:.0f} s each{', together' if args.together else ''}; before = {args.before_ref}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print("| workers | CPU µs/req before | CPU µs/req after | before / after "
          "| req/s before | req/s after | p50 ms before | p50 ms after |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, b, a in rows:
        print(f"| {n} | {b['cpu_us']:.0f} | {a['cpu_us']:.0f} | {b['cpu_us'] / a['cpu_us']:.2f}x "
              f"| {b['rps']:.0f} | {a['rps']:.0f} | {b['p50_ms']:.2f} | {a['p50_ms']:.2f} |")  # fmt: skip
