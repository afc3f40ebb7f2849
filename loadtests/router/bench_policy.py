"""CPU per routing decision as the fleet grows: cache_aware, cost_aware, round_robin (floor).

    python -m loadtests policy-cost [--workers 8,64,256,1000] [--requests 2000]
        [--warmup 2000] [--groups 512] [--system-chars 8000] [--tail-chars 500]
        [--policies cache_aware,round_robin,least_load] [--reports 1]

Workload: ``groups`` system prompts of ``system-chars`` chars, picked Zipf-like (a
few hot groups, a long tail), each followed by a unique tail of ``tail-chars``: the
SGLang "generated shared prefix" shape at the DESIGN budget's prompt size (8,000+
chars). Loads move the way a live fleet's do: before each request two random workers
get a new load (0–16) and, one request in 50, one worker a spike (+100), so the
imbalance rule fires now and then and hot prefixes replicate onto several workers.
Heartbeats: every worker reports its figures (a ``WorkerRecord``: 30 µs a prefill
token, 3 ms a decode step, 8 seats, a random queue, request time and hit rate) before
the first request, then ``--reports`` random workers report new figures before each one
(the simulator reports at every change; a live router reads the whole fleet once per
discovery interval). Only cost_aware reads them.
Each policy runs twice: on a list of ``WorkerView`` whose changed entries are
replaced, and on a ``FleetView`` (router/policy/base.py: id/load/capacity columns the
caller updates in place, as the simulator does); updates are outside the timed region.

Per request the timed region is exactly the delivery of that request's reports (written
into the view's ``reports`` column in place, as the router's table does; the frozen
reference takes them by ``set_costs``) and ``policy.select(...)``: CPU by
``time.thread_time_ns`` (does not count waiting for a core on a shared machine; the
timer pair's own cost, measured empty, is subtracted) and wall-clock p50/p99 by
``perf_counter_ns``. Every policy replays the same requests and load changes after
the same ``--warmup`` requests. ``views µs`` is what a caller pays to build a fresh
list of ``WorkerView`` per request (router/upstream/proxy.py does): measured once per size,
for scale, outside the policy.

``cost_aware_reference`` is cost_aware as it was before its price went over numpy
columns, frozen in tests/router/cost_aware_reference.py (run from the repository root):
with both in ``--policies`` the table shows them side by side and the last column says
whether they made the same decisions (worker and reason) on every request.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.load.workloads import text_of
from router.policy import build_policy
from router.policy.base import FleetView, Policy, RouteRequest, WorkerView
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord

VOCAB = [f"{a}{b}" for a in "bcdfghjklmnpqrstvwz" for b in ("a", "e", "i", "o", "u", "ay", "ee")]
POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class Row:
    workers: int
    policy: str
    cpu_us: float  # mean CPU per decision
    p50_us: float  # wall clock
    p99_us: float
    reasons: dict[str, int]
    decisions: list[tuple[str, str]]


def policy_requests(args: argparse.Namespace, rng: random.Random) -> list[str]:
    systems = [text_of(rng, args.system_chars, VOCAB) for _ in range(args.groups)]
    weights = [1.0 / (g + 1) for g in range(args.groups)]  # Zipf, exponent 1
    total = args.warmup + args.requests
    picks = rng.choices(range(args.groups), weights=weights, k=total)
    return [f"{systems[g]} {i} {text_of(rng, args.tail_chars, VOCAB)}" for i, g in enumerate(picks)]


def load_changes(n: int, total: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    """Per request, the (worker, new load) pairs to apply first: two random workers get
    a load in 0–16; every 50th request one gets +100 for that request only."""
    out: list[list[tuple[int, int]]] = []
    spiked = -1
    for r in range(total):
        step = [(rng.randrange(n), rng.randint(0, 16)) for _ in range(2)]
        if spiked >= 0:
            step.append((spiked, rng.randint(0, 16)))
            spiked = -1
        if r % 50 == 0:
            spiked = rng.randrange(n)
            step.append((spiked, 100 + rng.randint(0, 16)))
        out.append(step)
    return out


def cost_reports(
    n: int, total: int, per_request: int, rng: random.Random
) -> list[list[tuple[int, WorkerRecord]]]:
    """Per request (plus one first entry: the whole fleet), the heartbeats to apply."""

    def report(i: int) -> WorkerRecord:
        return WorkerRecord(
            f"worker-{i:04d}", "http://w", "m", "sim", 1.0,
            queued_prefill_tokens=rng.randrange(4_000), prefill_us_per_token=30.0,
            decode_ms_per_token=3.0, max_running_requests=8,
            request_ms=rng.uniform(50.0, 200.0), prompt_tokens_total=1_000_000,
            cached_tokens_total=rng.randrange(1_000_001),
        )  # fmt: skip

    first = [(i, report(i)) for i in range(n)]
    return [first] + [
        [(i, report(i)) for i in (rng.randrange(n) for _ in range(per_request))]
        for _ in range(total)
    ]


def build(name: str, seed: int) -> Policy:
    if name == "cost_aware_reference":  # the frozen copy: tests/ is importable from the root
        from tests.router.cost_aware_reference import CostAwareReference

        return CostAwareReference(RouterConfig(policy="cost_aware"), random.Random(seed))
    return build_policy(RouterConfig(policy=name), random.Random(seed))  # type: ignore[arg-type]


def timer_overhead_ns() -> float:
    t = time.thread_time_ns
    samples = []
    for _ in range(2000):
        a = t()
        samples.append(t() - a)
    return statistics.median(samples)


def run(policy: Policy, n: int, texts: list[str], changes: list[list[tuple[int, int]]],
        reports: list[list[tuple[int, WorkerRecord]]], warmup: int, overhead: float,
        columns: bool) -> Row:  # fmt: skip
    """``columns``: pass a FleetView updated in place; else a list of WorkerView with
    the changed entries replaced (the caller's objects are reused across requests)."""
    ids = [f"worker-{i:04d}" for i in range(n)]
    fleet = FleetView(ids, capacities=(65_536,) * n)
    views = [WorkerView(w, 0, 65_536) for w in ids]
    cpu: list[int] = []
    wall: list[int] = []
    reasons: dict[str, int] = {}
    decisions: list[tuple[str, str]] = []
    thread, perf = time.thread_time_ns, time.perf_counter_ns
    set_costs = getattr(policy, "set_costs", None)  # the frozen reference's input
    costs_of = None
    if set_costs is not None:
        from tests.router.cost_aware_reference import costs_of

    def deliver(beats: list[tuple[int, WorkerRecord]], now: float) -> None:
        for i, record in beats:
            if set_costs is not None and costs_of is not None:
                set_costs(ids[i], costs_of(record))
            elif columns:
                fleet.reports[i], fleet.reported_at[i] = record, now
                fleet.reported += 1
            else:
                v = views[i]
                views[i] = WorkerView(v.worker_id, v.load, 65_536, record, now)

    deliver(reports[0], 0.0)
    for r, (text, step, beats) in enumerate(zip(texts, changes, reports[1:], strict=True)):
        for i, load in step:
            fleet.loads[i] = load
            views[i] = WorkerView(ids[i], load, 65_536, views[i].report, views[i].reported_at)
        workers: Sequence[WorkerView] = fleet if columns else views
        request = RouteRequest(text)
        now = float(r) * 0.01
        c0, w0 = thread(), perf()
        deliver(beats, now)
        decision = policy.select(request, workers, now)
        w1, c1 = perf(), thread()
        if r >= warmup:
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        decisions.append((decision.worker_id, decision.reason))
    q = statistics.quantiles(wall, n=100)
    name = f"{policy.name} ({'FleetView' if columns else 'list'})"
    return Row(n, name, max(0.0, statistics.fmean(cpu) - overhead) / 1e3,
               statistics.median(wall) / 1e3, q[98] / 1e3, reasons, decisions)  # fmt: skip


def views_cost_us(n: int, repeats: int = 200) -> float:
    ids = [f"worker-{i:04d}" for i in range(n)]
    loads = list(range(n))
    t = time.thread_time_ns()
    for _ in range(repeats):
        [WorkerView(w, load, 65_536) for w, load in zip(ids, loads, strict=True)]
    return (time.thread_time_ns() - t) / repeats / 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64,256,1000")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=2000, help="timed requests per run")
    p.add_argument("--warmup", type=int, default=2000, help="untimed requests first")
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--system-chars", type=int, default=8000)
    p.add_argument("--tail-chars", type=int, default=500)
    p.add_argument("--reports", type=int, default=1, help="heartbeats before each request")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    texts = policy_requests(args, rng)
    mean_chars = statistics.fmean(len(t) for t in texts)
    overhead = timer_overhead_ns()
    policies = [p for p in args.policies.split(",") if p]
    print(f"{len(texts)} requests ({args.warmup} warm-up), mean {mean_chars:,.0f} chars; "
          f"timer pair {overhead:.0f} ns subtracted from CPU")  # fmt: skip
    print("| workers | policy | CPU µs / decision | wall p50 µs | wall p99 µs | "
          "× round_robin (list, CPU) | reasons | views µs | = reference |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---|---:|---|")
    for n in (int(x) for x in args.workers.split(",")):
        changes = load_changes(n, len(texts), random.Random(args.seed + n))
        reports = cost_reports(n, len(texts), args.reports, random.Random(args.seed + 2 * n))
        views_us = views_cost_us(n)
        rows = {}
        for name in policies:
            for columns in (False, True):
                policy = build(name, args.seed)
                row = run(policy, n, texts, changes, reports, args.warmup, overhead, columns)
                rows[row.policy] = row
        floor = rows.get("round_robin (list)")
        for name, row in rows.items():
            ratio = f"{row.cpu_us / floor.cpu_us:.1f}" if floor and floor.cpu_us else "-"
            reasons = " ".join(f"{k} {v}" for k, v in sorted(row.reasons.items()))
            ref = rows.get(name.replace("cost_aware", "cost_aware_reference", 1))
            same = (
                ""
                if ref is None or ref is row
                else "yes"
                if ref.decisions == row.decisions
                else "NO"
            )
            shown = reasons if name.startswith(("cache_aware", "cost_aware")) else ""
            print(f"| {n} | {name} | {row.cpu_us:.1f} | {row.p50_us:.1f} | {row.p99_us:.1f} | "
                  f"{ratio} | {shown} | {views_us:.1f} | {same} |", flush=True)  # fmt: skip
