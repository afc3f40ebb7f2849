"""Worker HTTP overhead: the sim engine at zero cost, called in process vs through HTTP.

Both sides run the same workload in one run (shared system prompts + unique
questions, `max_tokens` output tokens) at the same concurrency:

- `in-process`: `engine.generate()` iterated directly (the floor: tokenizer, radix
  cache, sim bookkeeping);
- `http`: a real `radix-worker serve --engine sim` subprocess, an aiohttp client
  posting `/v1/completions` (JSON) and, with `--stream`, SSE streams.

    python -m loadtests worker-http --requests 2000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from loadtests.options import HelpFormatter
from shared.config import WorkerConfig
from shared.redis_server import free_port
from worker.backends import build_engine
from worker.engine.types import EngineRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int) -> list[str]:
    systems = [f"System prompt {k}: you are assistant number {k}. " * 30 for k in range(8)]
    return [systems[i % len(systems)] + f"Question {i}: what is {i} squared?" for i in range(n)]


async def drive(
    jobs: list[str], concurrency: int, one: Callable[[int, str], Awaitable[None]]
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(jobs):
        queue.put_nowait(item)

    async def worker() -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            t0 = time.perf_counter()
            await one(i, prompt)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


async def in_process(
    jobs: list[str], concurrency: int, max_tokens: int
) -> tuple[float, list[float]]:
    engine = build_engine(
        WorkerConfig(engine="sim", cache_tokens=2_000_000, max_running_requests=256)
    )
    await engine.start()

    async def one(i: int, prompt: str) -> None:
        req = EngineRequest(f"r{i}", prompt=prompt, params=SamplingParams(max_tokens=max_tokens))
        async for _ in engine.generate(req):
            pass

    try:
        return await drive(jobs, concurrency, one)
    finally:
        await engine.stop()


async def over_http(
    url: str, jobs: list[str], concurrency: int, max_tokens: int, stream: bool
) -> tuple[float, list[float]]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int, prompt: str) -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

        return await drive(jobs, concurrency, one)


def start_worker() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "worker", "serve", "--engine", "sim", "--host", "127.0.0.1",
           "--port", str(port), "--cache-tokens", "2000000", "--max-running-requests", "256",
           "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("worker did not become healthy")


def row(name: str, n: int, elapsed: float, lat: list[float], base_rps: float | None) -> str:
    rps = n / elapsed
    p50 = statistics.median(lat) * 1e3
    p99 = sorted(lat)[int(0.99 * (len(lat) - 1))] * 1e3
    ratio = f"{base_rps / rps:.2f}x" if base_rps else "1.00x"
    return f"| {name:<22} | {n:>6} | {rps:>9.0f} | {p50:>7.2f} | {p99:>7.2f} | {ratio:>10} |"


async def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    jobs = prompts(args.requests)
    proc, url = start_worker()
    try:
        await over_http(url, jobs[:100], args.concurrency, args.max_tokens, False)  # warm-up
        base = await in_process(jobs, args.concurrency, args.max_tokens)
        plain = await over_http(url, jobs, args.concurrency, args.max_tokens, False)
        streamed = await over_http(url, jobs, args.concurrency, args.max_tokens, True)
    finally:
        proc.terminate()
        proc.wait(30)
    base_rps = args.requests / base[0]
    print(f"sim engine, zero cost; {args.requests} requests, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, prompts ~{len(jobs[0])} chars")  # fmt: skip
    print("| path                   | reqs   | req/s     | p50 ms  | p99 ms  | slowdown   |")
    print("|------------------------|--------|-----------|---------|---------|------------|")
    print(row("in-process engine", args.requests, *base, None))
    print(row("HTTP /v1/completions", args.requests, *plain, base_rps))
    print(row("HTTP stream (SSE)", args.requests, *streamed, base_rps))


def main(argv: list[str] | None = None) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_main(argv))
