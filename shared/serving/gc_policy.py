"""Python's garbage collector, set for a server that allocates per request.

The rule: what start-up built (modules, the app, the fleet, the policy's tables) is
frozen out of every collection, and the young generation is collected seldom enough
that its cost per request is small, while no request makes a reference cycle, so what a
request allocates is freed by reference counting the moment it ends
(tests/router/test_gc_cycles.py holds the router to 0 cycles per request).

Why: with the interpreter's defaults (700, 10, 10) the router collected every ~100
requests and now and then made a full pass over the whole heap (~72k start-up objects:
every module, the app): 0.24-0.32 ms of CPU per request with the KV index on
(loadtests/results/kv_events.md). Measured on the router itself (2 cores, load average
~10 from other jobs, wrk at 32 connections for 6 s, ~7,500 requests, a zero-cost
echoing sim worker; gc callbacks timing every pass, start-up excluded):

| settings | collections gen 0 / 1 / 2 | time in them | longest pause |
|---|---|---|---|
| defaults (700, 10, 10) | 81 / 8 / 1 | 99 ms | 73 ms (the full pass) |
| frozen + (20000, 20, 100) | 0 / 0 / 0 | 0 ms | - |

- GEN0 = 20,000: the net count of tracked objects allocated (allocations minus frees)
  between gen-0 passes. A request frees what it allocates (no cycles), so the count
  grows only by what outlives requests for a while (requests in flight, tree nodes of
  new prompts): ~7 objects a request above (81 x 700 / 7,500), so a gen-0 pass every
  ~2,800 requests instead of every ~100, each over at most 20k young objects.
- GEN1 = 20: gen-1 passes (over what survived gen 0) every 20 gen-0 passes.
- GEN2 = 100: a full pass (all but the frozen) is also held back until the objects
  waiting for it exceed 25% of those already in gen 2 (CPython's own rule), so it stays
  rare as the trees grow; freezing keeps start-up's objects out of it altogether.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

GEN0, GEN1, GEN2 = 20_000, 20, 100


def tune_for_serving() -> None:
    """Thresholds for a request-serving process (the module says why these)."""
    gc.set_threshold(GEN0, GEN1, GEN2)


def freeze_startup() -> int:
    """Collect once, then move every object alive now into the permanent generation,
    which no collection visits again; returns how many were frozen. Call it when start-up
    is done (the app built, the fleet first read): objects frozen never get freed by the
    collector, so it suits what lives as long as the process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class FrozenCollector(Collector):
    """`python_gc_frozen_objects`: what `freeze_startup` took out of every collection
    (0: not frozen). Beside prometheus_client's `python_gc_collections_total`."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "python_gc_frozen_objects",
            "Objects in the permanent generation (frozen after start-up): never collected",
            value=gc.get_freeze_count(),
        )
