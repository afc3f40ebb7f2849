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
- ``PrefixTree``: router/policy/tree.py, one shared tree, no budget (nothing evicted).
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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Protocol

import pygtrie

from loadtests.load.workloads import text_of
from router.policy import build_policy
from router.policy.base import RouteRequest, WorkerView
from router.policy.tree import PrefixTree
from shared.config import RouterConfig

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
]


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
    policy = build_policy(RouterConfig(), random.Random(0))
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


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--system-chars", type=int, default=8000)
    p.add_argument("--tail-chars", type=int, default=500)
    p.add_argument("--memory-requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
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
            f"| {pct(both, 50):.1f} | {pct(both, 99):.1f} | {statistics.fmean(both):.1f} | {cpu[name]:.1f} "
            f"| {'' if mem is None else f'{mem:.1f}'} |"
        )
    sel, sel_cpu = replay_policy(requests, workers)
    print(
        f"| CacheAware.select (rule + tree) | | | {pct(sel, 50):.1f} | {pct(sel, 99):.1f} "
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
