"""The router's CPU per routing decision: whole policies as the fleet grows (`policy-cost`,
below) and the prefix tree alone against a pygtrie baseline (`tree`, TREE below), on
prompts of the same shape (`add_prompt_arguments`).

`policy-cost`: cache_aware, cost_aware, round_robin (floor).

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
import os
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loadtests.kit import Command, pct
from loadtests.load.workloads import text_of
from router.holdings.tree import PrefixTree
from router.policy import build_routing
from router.policy.base import FleetView, RouteRequest, WorkerView
from router.routing import Routing
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord
from tests.router.cost_aware_reference import CostAwareReference

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


def build(name: str, seed: int) -> Routing | CostAwareReference:
    if name == "cost_aware_reference":  # the frozen copy: tests/ is importable from the root
        return CostAwareReference(RouterConfig(policy="cost_aware"), random.Random(seed))
    return build_routing(RouterConfig(policy=name), random.Random(seed))  # type: ignore[arg-type]


def timer_overhead_ns() -> float:
    t = time.thread_time_ns
    samples = []
    for _ in range(2000):
        a = t()
        samples.append(t() - a)
    return statistics.median(samples)


def run(policy: Routing | CostAwareReference, n: int, texts: list[str], changes: list[list[tuple[int, int]]],
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
    named = policy.policy if isinstance(policy, Routing) else policy
    name = f"{named.name} ({'FleetView' if columns else 'list'})"
    return Row(n, name, max(0.0, statistics.fmean(cpu) - overhead) / 1e3,
               statistics.median(wall) / 1e3, q[98] / 1e3, reasons, decisions)  # fmt: skip


def views_cost_us(n: int, repeats: int = 200) -> float:
    ids = [f"worker-{i:04d}" for i in range(n)]
    loads = list(range(n))
    t = time.thread_time_ns()
    for _ in range(repeats):
        [WorkerView(w, load, 65_536) for w, load in zip(ids, loads, strict=True)]
    return (time.thread_time_ns() - t) / repeats / 1e3


def add_prompt_arguments(p: argparse.ArgumentParser, groups: int) -> None:
    """The prompts both commands route: `--groups` system prompts and unique tails."""
    p.add_argument("--requests", type=int, default=2000, help="timed requests per run")
    p.add_argument("--groups", type=int, default=groups, help="system prompts")
    p.add_argument("--system-chars", type=int, default=8000, help="chars of a system prompt")
    p.add_argument("--tail-chars", type=int, default=500, help="chars of a request's own tail")
    p.add_argument("--seed", type=int, default=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64,256,1000")
    p.add_argument("--policies", default=",".join(POLICIES))
    add_prompt_arguments(p, groups=512)
    p.add_argument("--warmup", type=int, default=2000, help="untimed requests first")
    p.add_argument("--reports", type=int, default=1, help="heartbeats before each request")


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


# -- tree --------------------------------------------------------------------------------
WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
         "are", "as", "with", "his", "they", "at", "be", "this"]  # fmt: skip


class Index(Protocol):
    def match(self, text: str) -> dict[str, int]: ...
    def insert(self, text: str, tenant: str, now: float) -> None: ...
    def stored_chars(self) -> int: ...


class OwnTree:
    def __init__(self, max_chars: int | None = None) -> None:
        self.tree: PrefixTree[str] = PrefixTree(max_chars=max_chars)
        self.match = self.tree.match
        self.insert = self.tree.insert

    def stored_chars(self) -> int:
        return self.tree.total_chars


class PygtrieBaseline:
    def __init__(self, workers: list[str]) -> None:
        import pygtrie  # the baseline only: policy-cost runs without it

        self.tries = {w: pygtrie.CharTrie() for w in workers}

    def match(self, text: str) -> dict[str, int]:
        out = {}
        for w, trie in self.tries.items():
            steps = -1  # the first step is the root
            try:
                for _ in trie.walk_towards(text):
                    steps += 1
            except KeyError:
                pass
            if steps > 0:
                out[w] = steps
        return out

    def insert(self, text: str, tenant: str, now: float) -> None:
        self.tries[tenant][text] = now

    def stored_chars(self) -> int:
        # A trie keeps one node per distinct prefix: per sorted key, the chars beyond
        # its common prefix with the previous key.
        total = 0
        for trie in self.tries.values():
            prev = ""
            for key in sorted(trie.iterkeys()):
                total += len(key) - len(os.path.commonprefix([prev, key]))  # noqa: RUF071 (untimed)
                prev = key
        return total


def tree_requests(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)

    def words(n_chars: int) -> str:
        return text_of(rng, n_chars, WORDS)[:n_chars]

    systems = [f"[system {g}] " + words(args.system_chars) for g in range(args.groups)]
    return [
        systems[rng.randrange(args.groups)] + f"\n[user {i}] " + words(args.tail_chars)
        for i in range(args.requests)
    ]


def replay(
    index: Index, requests: list[str], workers: list[str]
) -> tuple[list[float], list[float], int, list[str]]:
    """Per request wall µs for match and for insert, a checksum of every match, and the
    worker each request went to."""
    match_us, insert_us, checksum, rr, chosen = [], [], 0, 0, []
    clock = time.perf_counter_ns
    for now, text in enumerate(requests):
        t0 = clock()
        got = index.match(text)
        t1 = clock()
        best = max(got, key=lambda w: (got[w], w), default=None)
        if best is None or got[best] <= 0.3 * len(text):
            best, rr = workers[rr % len(workers)], rr + 1
        t2 = clock()
        index.insert(text, best, now)
        t3 = clock()
        match_us.append((t1 - t0) / 1e3)
        insert_us.append((t3 - t2) / 1e3)
        checksum += sum(got.values())
        chosen.append(best)
    return match_us, insert_us, checksum, chosen


def cpu_per_request(index: Index, requests: list[str], chosen: list[str]) -> float:
    """CPU µs (thread time) per match+insert, replaying known decisions with no timers
    inside the loop: what the structure costs, whatever else runs on the machine."""
    match, insert = index.match, index.insert
    cpu0 = time.thread_time_ns()
    for now, (text, worker) in enumerate(zip(requests, chosen, strict=True)):
        match(text)
        insert(text, worker, now)
    return (time.thread_time_ns() - cpu0) / 1e3 / max(1, len(requests))


def replay_policy(requests: list[str], workers: list[str]) -> tuple[list[float], float]:
    policy = build_routing(RouterConfig(), random.Random(0))
    fleet = [WorkerView(w, load=0) for w in workers]
    us = []
    cpu0 = time.thread_time_ns()
    for now, text in enumerate(requests):
        t0 = time.perf_counter_ns()
        policy.select(RouteRequest(text), fleet, now)
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return us, (time.thread_time_ns() - cpu0) / 1e3 / max(1, len(requests))


def bytes_per_char(make: Callable[[], Index], requests: list[str], workers: list[str]) -> float:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = make()
        replay(index, requests, workers)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return used / index.stored_chars()


def tree_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=16)
    add_prompt_arguments(p, groups=64)
    p.add_argument("--memory-requests", type=int, default=300)


def tree_main(args: argparse.Namespace) -> None:
    requests = tree_requests(args)
    workers = [f"w{i}" for i in range(args.workers)]
    avg_chars = sum(map(len, requests)) / len(requests)
    print(
        f"{len(requests)} requests, {args.workers} workers, {args.groups} system prompts of "
        f"{args.system_chars} chars + {args.tail_chars}-char tails (mean {avg_chars:.0f} chars)"
    )
    probe = OwnTree()
    chosen = replay(probe, requests, workers)[3]
    budget = max(1, probe.stored_chars() // 4)
    makers: dict[str, Callable[[], Index]] = {
        "PrefixTree": OwnTree,
        f"PrefixTree, budget {budget:,}": lambda: OwnTree(budget),
        "pygtrie (walk_towards)": lambda: PygtrieBaseline(workers),
    }
    rows = {name: replay(make(), requests, workers) for name, make in makers.items()}
    cpu = {name: cpu_per_request(make(), requests, chosen) for name, make in makers.items()}
    own, base = rows["PrefixTree"], rows["pygtrie (walk_towards)"]
    assert own[2] == base[2], f"match results differ: {own[2]} vs {base[2]}"
    assert own[3] == base[3] == chosen, "the implementations routed differently"
    mem_reqs = requests[: args.memory_requests]
    memory = {
        "PrefixTree": bytes_per_char(OwnTree, mem_reqs, workers),
        "pygtrie (walk_towards)": bytes_per_char(
            lambda: PygtrieBaseline(workers), mem_reqs, workers
        ),
    }
    print(
        "| implementation | match/s | insert/s | match+insert µs p50 | p99 | mean | CPU µs/req | bytes/stored char |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (m, i, _, _) in rows.items():
        both = [a + b for a, b in zip(m, i, strict=True)]
        mem = memory.get(name)
        print(
            f"| {name} | {1e6 / statistics.fmean(m):,.0f} | {1e6 / statistics.fmean(i):,.0f} "
            f"| {pct(both, 0.5):.1f} | {pct(both, 0.99):.1f} | {statistics.fmean(both):.1f} | {cpu[name]:.1f} "
            f"| {'' if mem is None else f'{mem:.1f}'} |"
        )
    sel, sel_cpu = replay_policy(requests, workers)
    print(
        f"| CacheAware.select (rule + tree) | | | {pct(sel, 0.5):.1f} | {pct(sel, 0.99):.1f} "
        f"| {statistics.fmean(sel):.1f} | {sel_cpu:.1f} | |"
    )
    own_mean = statistics.fmean(a + b for a, b in zip(own[0], own[1], strict=True))
    base_mean = statistics.fmean(a + b for a, b in zip(base[0], base[1], strict=True))
    print(
        f"\nmatch+insert, pygtrie / PrefixTree: {base_mean / own_mean:.0f}× (mean wall µs), "
        f"{cpu['pygtrie (walk_towards)'] / cpu['PrefixTree']:.0f}× (CPU µs)"
    )
    print(
        f"memory, pygtrie / PrefixTree (bytes per stored char): "
        f"{memory['pygtrie (walk_towards)'] / memory['PrefixTree']:.0f}×"
    )


TREE = Command(
    """The router's prefix tree vs a pygtrie baseline, side by side on one workload.

    python -m loadtests tree [--requests 2000] [--workers 16] [--groups 64]
        [--system-chars 8000] [--tail-chars 500] [--seed 0]

Workload (SGLang's "generated shared prefix" shape, in characters): ``groups``
system prompts of ``system-chars`` chars, each request one of them (uniform) plus a
unique tail of ``tail-chars``. Per request: match the text against every worker's
tree, pick the worker (best match if its rate is > 0.3, else round robin, the same
decision for every implementation), insert the text for it. Every implementation
replays the same requests and must return the same matches (checked).

Rows:
- ``PrefixTree``: router/holdings/tree.py, one shared tree, no budget (nothing evicted).
- ``PrefixTree, budget``: the same with a global budget of a quarter of what the
  workload stores, so eviction runs throughout.
- ``pygtrie``: one ``pygtrie.CharTrie`` per worker. ``longest_prefix`` only finds a
  whole stored key that prefixes the text, which is not the question (the longest
  common prefix with any stored text), so the match walks the trie's nodes along the
  text with ``walk_towards`` (public API) and counts the steps.
- ``CacheAware.select``: the whole cache_aware policy (match, rule, insert) per request.

Times: wall-clock µs per request of match+insert (p50, p99, mean), and CPU µs per
match+insert by thread time over a second replay of the same decisions with no
timers in the loop (unlike wall time it does not count the time the process waits
for a core on a shared machine). ``CacheAware.select`` CPU includes its loop's timers.

Memory is a second, untimed replay of the first ``--memory-requests`` requests
under tracemalloc: bytes held by the structure per stored char (PrefixTree: chars in
its nodes, shared nodes once; pygtrie: one node per char per worker trie).
""",
    tree_arguments,
    tree_main,
)
