"""Several router replicas behind a round-robin front, with and without replica sync.

    python -m loadtests replicas --replicas 1,2,3 --workloads multi_turn,shared_prefix

One local sim fleet (Redis + `--workers` sim workers with bounded caches) stays up; for
each workload, replica count n and sync off/on, n fresh `python -m router serve`
processes start (policy cache_aware, `RADIX_ROUTER_SYNC`), every worker cache is
flushed and the decision stream deleted, and the same workload runs with request i
sent to replica i mod n (how a Kubernetes Service spreads connections). Printed, one
row per run: hit rate (sum of the workers' `cached_tokens` / `prompt_tokens` from each
response's usage), TTFT and latency p50 at the client, requests per worker (max/mean),
extra placements (per group, distinct workers that served it minus one, from the
`x-radix-worker` header),
and router CPU per request (utime+stime of every replica process from /proc/<pid>/stat
before and after the run, summed, divided by the requests).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from loadtests.kit import WorkloadOptions
from loadtests.load.cluster import Child, Cluster, ClusterSpec
from loadtests.load.records import SSEParser
from loadtests.load.workloads import LLMRequest, Workload
from shared.wire.registry import Registry

WORKLOADS: dict[str, WorkloadOptions] = {
    "multi_turn": WorkloadOptions(
        # A short shared system prompt: each conversation's own turns decide where it
        # goes (a long shared one sends every chat to whichever worker holds it first).
        workload="multi_turn", conversations=48, turns=6, system_len=16, question_len=48,
        output_len=16,
    ),
    "shared_prefix": WorkloadOptions(
        workload="shared_prefix", groups=48, prompts_per_group=8, system_len=256,
        question_len=32, output_len=16,
    ),
}  # fmt: skip
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces: split after its closing parenthesis.
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


async def reset_sync_state(redis_url: str) -> None:
    """Delete the decision stream, so a run's replicas do not replay an earlier run."""
    redis = Redis.from_url(redis_url)
    try:
        await redis.delete(Registry(redis).decisions_stream)
    finally:
        await redis.aclose()


@dataclass
class Record:
    status: int
    worker: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tag: str = ""  # group / conversation: which requests share a prefix


async def send(
    http: aiohttp.ClientSession, url: str, req: LLMRequest, model: str
) -> tuple[Record, str]:
    """Stream one request; return its record and the generated text."""
    path = "/v1/completions" if req.endpoint == "completions" else "/v1/chat/completions"
    start = time.perf_counter()
    text: list[str] = []
    async with http.post(url + path, json=req.body(model, stream=True)) as r:
        rec = Record(r.status, r.headers.get("x-radix-worker", ""), tag=req.tag)
        if r.status != 200:
            await r.read()
            return rec, ""
        parser = SSEParser()
        async for chunk in r.content.iter_any():
            for data in parser.feed(chunk):
                if not rec.ttft_s:
                    rec.ttft_s = time.perf_counter() - start
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                for choice in event.get("choices") or ():
                    text.append(
                        (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    )
                if usage := event.get("usage"):
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
    rec.latency_s = time.perf_counter() - start
    return rec, "".join(text)


async def drive(urls: list[str], options: WorkloadOptions, users: int) -> list[Record]:
    """`users` closed-loop users; the i-th request of the run goes to replica i mod n."""
    workload = Workload(options)
    counter = itertools.count()
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        async with http.get(urls[0] + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def user() -> None:
            session = workload.new_session()
            while (req := session.next_request()) is not None:
                rec, reply = await send(http, urls[next(counter) % len(urls)], req, model)
                records.append(rec)
                session.on_reply(req, reply)

        await asyncio.gather(*(user() for _ in range(users)))
    return records


@dataclass(frozen=True)
class Row:
    workload: str
    replicas: int
    sync: bool
    requests: int
    failures: int
    hit_rate: float
    ttft_p50_ms: float
    latency_p50_ms: float
    max_over_mean: float
    cpu_ms_per_request: float
    idle_ms_per_request: float
    wall_s: float
    # Placements beyond the first per tag: Σ (distinct workers that served a group - 1).
    extra_placements: int = 0


def summarize(
    workload: str, n: int, sync: bool, records: list[Record], workers: int, cpu_s: float,
    idle_cpu_per_s: float, wall_s: float,
) -> Row:  # fmt: skip
    ok = [r for r in records if r.status == 200]
    prompt = sum(r.prompt_tokens for r in ok)
    per_worker = Counter(r.worker for r in ok)
    mean = len(ok) / workers  # over the whole cluster: a worker sent nothing counts as 0
    served: dict[str, set[str]] = {}
    for r in ok:
        served.setdefault(r.tag, set()).add(r.worker)
    return Row(
        workload, n, sync, len(records), len(records) - len(ok),
        sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        1000 * statistics.median(r.ttft_s for r in ok) if ok else 0.0,
        1000 * statistics.median(r.latency_s for r in ok) if ok else 0.0,
        max(per_worker.values()) / mean if mean else 0.0,
        1000 * cpu_s / len(records) if records else 0.0,
        1000 * idle_cpu_per_s * wall_s / len(records) if records else 0.0, wall_s,
        sum(len(ws) - 1 for ws in served.values()),
    )  # fmt: skip


def start_replicas(cluster: Cluster, n: int, sync: bool) -> list[Child]:
    """n fresh routers on the fleet's Redis and workers (the fleet stops them at the end)."""
    settings: dict[str, object] = {"policy": "cache_aware", "sync": sync, "log_level": "WARNING"}
    return [cluster.add_router(f"router-{i}", settings) for i in range(n)]


def measure(cluster: Cluster, workload: str, n: int, sync: bool, users: int, idle_s: float) -> Row:
    assert cluster.redis is not None
    cluster.flush()
    asyncio.run(reset_sync_state(cluster.redis.url))
    replicas = start_replicas(cluster, n, sync)
    try:
        # What the replicas burn with no traffic (discovery, sync's load and read loops),
        # so the table can show the per-request part apart from this background.
        idle0 = sum(cpu_seconds(r.pid) for r in replicas)
        time.sleep(idle_s)
        cpu0 = sum(cpu_seconds(r.pid) for r in replicas)
        idle_rate = (cpu0 - idle0) / idle_s
        start = time.perf_counter()
        records = asyncio.run(drive([r.url for r in replicas], WORKLOADS[workload], users))
        wall = time.perf_counter() - start
        cpu = sum(cpu_seconds(r.pid) for r in replicas) - cpu0
    finally:
        for replica in replicas:
            replica.stop(grace_s=15)
    return summarize(workload, n, sync, records, len(cluster.workers), cpu, idle_rate, wall)


def table(rows: list[Row]) -> str:
    lines = [
        "| workload | replicas | sync | requests | failures | hit rate | vs 1 replica (points) "
        "| TTFT p50 (ms) | latency p50 (ms) | max/mean per worker | router CPU ms/request "
        "| of which idle background | extra placements |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r.workload, r.sync): r.hit_rate for r in rows if r.replicas == 1}
    for r in rows:
        ref = base.get((r.workload, r.sync), base.get((r.workload, False)))
        delta = f"{100 * (r.hit_rate - ref):+.1f}" if ref is not None else "n/a"
        lines.append(
            f"| {r.workload} | {r.replicas} | {'on' if r.sync else 'off'} | {r.requests} | "
            f"{r.failures} | {r.hit_rate:.3f} | {delta} | {r.ttft_p50_ms:.0f} | "
            f"{r.latency_p50_ms:.0f} | {r.max_over_mean:.2f} | {r.cpu_ms_per_request:.3f} | "
            f"{r.idle_ms_per_request:.3f} | {r.extra_placements} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default="1,2,3", help="comma-separated replica counts")
    p.add_argument("--workloads", default="multi_turn,shared_prefix")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=8192, help="KV capacity per worker")
    p.add_argument("--prefill-us", type=float, default=30.0)
    p.add_argument("--decode-ms", type=float, default=3.0)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=2.0, help="idle CPU baseline per run")
    p.add_argument("--scale", type=float, default=1.0, help="multiply conversations/groups")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")


def main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.replicas.split(",")]
    names = [w.strip() for w in args.workloads.split(",")]
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        o = WORKLOADS[name]
        WORKLOADS[name] = replace(
            o, conversations=max(1, round(o.conversations * args.scale)),
            groups=max(1, round(o.groups * args.scale)),
        )  # fmt: skip
    spec = ClusterSpec(
        workers=args.workers, cache_tokens=args.cache_tokens, prefill_us_per_token=args.prefill_us,
        decode_ms_per_token=args.decode_ms, max_running_requests=args.max_running,
    )  # fmt: skip
    rows: list[Row] = []
    with spec.start() as cluster:
        for name in names:
            for n in counts:
                for sync in (False, True):
                    row = measure(cluster, name, n, sync, args.users, args.idle_s)
                    rows.append(row)
                    print(f"{name} replicas={n} sync={'on' if sync else 'off'}: hit rate "
                          f"{row.hit_rate:.3f}, {row.extra_placements} extra placements, "
                          f"{row.cpu_ms_per_request:.3f} ms CPU/request, "
                          f"{row.wall_s:.1f}s", flush=True)  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
    return 1 if any(r.failures for r in rows) else 0
