"""Worker HTTP overhead: the sim engine in process vs through HTTP, worker CPU per token.

    python -m loadtests worker-http --requests 300 --concurrency 64 --max-tokens 128
        [--step-ms 5] [--before-ref main] [--rounds 3]

Both sides run the same workload in one run (shared system prompts + unique
questions, `max_tokens` output tokens) at the same concurrency:

- `in-process`: `engine.generate()` iterated directly (the floor: tokenizer, radix
  cache, sim bookkeeping);
- `http`: a real `radix-worker serve --engine sim` subprocess, an aiohttp client
  posting `/v1/completions` as JSON and as SSE streams.

Besides req/s (which the client on the same cores shares), each HTTP row reports the
worker process's own CPU per output token: its utime + stime (all threads, from
/proc/<pid>/stat) over the phase ÷ the completion tokens the answers' usage reports.
The in-process row's CPU is this process's own over its phase (the engine floor);
`events/token` is SSE events received per output token (below 1: deltas merged). With
`--step-ms`, every engine step costs that long (the sim sleeps in its step thread, as a
GPU step leaves the GIL free), so outputs arrive one step at a time as on a GPU. With
`--before-ref`, a second worker built from that git ref (`git archive` of `worker` and
`shared` into a temp dir) serves the same phases, alternating with this tree's worker
for `--rounds` rounds; CPU and tokens add up over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtests.kit import checkout, cpu_seconds
from loadtests.load.cluster import ROOT, Child, serve
from shared.config import WorkerConfig
from shared.redis_server import free_port
from worker.backends import build_engine
from worker.engine.types import EngineRequest, SamplingParams


def prompts(n: int) -> list[str]:
    systems = [f"System prompt {k}: you are assistant number {k}. " * 30 for k in range(8)]
    return [systems[i % len(systems)] + f"Question {i}: what is {i} squared?" for i in range(n)]


@dataclass
class Phase:
    """One path's totals, summed over rounds."""

    requests: int = 0
    seconds: float = 0.0
    tokens: int = 0
    cpu: float = 0.0  # the serving process's utime + stime
    events: int = 0  # SSE data events received, [DONE] and the usage chunk not counted
    latencies: list[float] = field(default_factory=list)

    def add(self, other: Phase) -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.tokens += other.tokens
        self.cpu += other.cpu
        self.events += other.events
        self.latencies += other.latencies

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_us_per_token(self) -> float:
        return self.cpu / max(1, self.tokens) * 1e6


async def drive(
    jobs: list[str], concurrency: int, one: Callable[[int, str], Awaitable[int]]
) -> Phase:
    """Runs every job, `concurrency` at a time; `one` returns the completion tokens."""
    phase = Phase(requests=len(jobs))
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(jobs):
        queue.put_nowait(item)

    async def worker() -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            t0 = time.perf_counter()
            tokens = await one(i, prompt)  # not `+= await`: that reads the sum before
            phase.tokens += tokens
            phase.latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.seconds = time.perf_counter() - start
    return phase


def _own_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


async def in_process(jobs: list[str], concurrency: int, max_tokens: int, step_ms: float) -> Phase:
    config = WorkerConfig(
        engine="sim", cache_tokens=2_000_000, max_running_requests=256,
        sim_decode_ms_per_token=step_ms,
    )  # fmt: skip
    engine = build_engine(config)
    await engine.start()

    async def one(i: int, prompt: str) -> int:
        req = EngineRequest(f"r{i}", prompt=prompt, params=SamplingParams(max_tokens=max_tokens))
        tokens = 0
        async for out in engine.generate(req):
            tokens = out.completion_tokens
        return tokens

    try:
        cpu = _own_cpu()
        phase = await drive(jobs, concurrency, one)
        phase.cpu = _own_cpu() - cpu
        return phase
    finally:
        await engine.stop()


def _streamed(body: bytes) -> tuple[int, int]:
    """Completion tokens (the usage chunk's, the event before [DONE]) and delta events."""
    events = body.rstrip().split(b"\n\n")
    assert events[-1] == b"data: [DONE]", events[-1][:200]
    usage = json.loads(events[-2].removeprefix(b"data: "))["usage"]
    return usage["completion_tokens"], len(events) - 2


async def over_http(
    url: str, pid: int, jobs: list[str], concurrency: int, max_tokens: int, stream: bool
) -> Phase:
    connector = aiohttp.TCPConnector(limit=concurrency)
    events = 0
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int, prompt: str) -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                raw = await resp.read()
            if not stream:
                return json.loads(raw)["usage"]["completion_tokens"]
            nonlocal events
            tokens, n = _streamed(raw)
            events += n
            return tokens

        cpu = cpu_seconds(pid)
        phase = await drive(jobs, concurrency, one)
        phase.cpu = cpu_seconds(pid) - cpu
        phase.events = events
        return phase


def start_worker(name: str, step_ms: float, logs: Path, tree: Path = ROOT) -> Child:
    port = free_port()
    args = ["worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--cache-tokens", "2000000", "--max-running-requests", "256",
            "--sim-decode-ms-per-token", str(step_ms), "--log-level", "WARNING"]  # fmt: skip
    return serve(name, args, port, logs, tree=tree)


HEADER = (
    "| path                      | reqs  | req/s  | p50 ms  | p99 ms  | tokens/s | CPU µs/token "
    "| events/token |\n|---------------------------|-------|--------|---------|---------|"
    "----------|--------------|--------------|"
)


def row(name: str, p: Phase) -> str:
    p50 = statistics.median(p.latencies) * 1e3
    p99 = sorted(p.latencies)[int(0.99 * (len(p.latencies) - 1))] * 1e3
    return (
        f"| {name:<25} | {p.requests:>5} | {p.rps:>6.0f} | {p50:>7.2f} | {p99:>7.2f} "
        f"| {p.tokens / p.seconds:>8.0f} | {p.cpu_us_per_token:>12.1f} "
        f"| {f'{p.events / max(1, p.tokens):.2f}' if p.events else '':>12} |"
    )


async def run_rounds(
    args: argparse.Namespace,
    jobs: list[str],
    workers: dict[str, Child],
    totals: dict[str, Phase],
) -> None:
    """Every phase `args.rounds` times; the workers' order flips every round."""
    c, m, step_ms = args.concurrency, args.max_tokens, args.step_ms
    for child in workers.values():  # warm-up: imports, caches, connections
        await over_http(child.url, child.pid, jobs[:100], c, m, False)
        await over_http(child.url, child.pid, jobs[:100], c, m, True)
    for rnd in range(args.rounds):
        order = list(workers.items())[:: -1 if rnd % 2 else 1]
        totals.setdefault("in-process engine", Phase()).add(await in_process(jobs, c, m, step_ms))
        for stream in (False, True):
            for name, child in order:
                label = f"{'SSE' if stream else 'JSON'}, {name}"
                phase = await over_http(child.url, child.pid, jobs, c, m, stream)
                totals.setdefault(label, Phase()).add(phase)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000, help="per phase and round")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="what one engine step costs (sim sleep)"
    )
    p.add_argument("--before-ref", help="also serve from this git ref's worker, alternating")
    p.add_argument("--rounds", type=int, default=1, help="alternations of every phase")


async def _main(args: argparse.Namespace) -> None:
    jobs = prompts(args.requests)
    totals: dict[str, Phase] = {}
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="worker-http-")))
        workers: dict[str, Child] = {}
        if args.before_ref:
            before = stack.enter_context(checkout(args.before_ref))
            workers[f"before ({args.before_ref})"] = start_worker(
                "before", args.step_ms, logs, before
            )
            stack.callback(workers[f"before ({args.before_ref})"].stop)
        workers["this tree"] = start_worker("after", args.step_ms, logs)
        stack.callback(workers["this tree"].stop)
        await run_rounds(args, jobs, workers, totals)
    print(f"sim engine; {args.requests} requests x {args.rounds} rounds, "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"step {args.step_ms} ms, prompts ~{len(jobs[0])} chars; "
          "CPU: the serving process's utime+stime")  # fmt: skip
    print(HEADER)
    for label in sorted(totals, key=lambda k: (k != "in-process engine", k)):
        print(row(label, totals[label]))


def main(args: argparse.Namespace) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_main(args))
