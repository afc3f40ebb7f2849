"""Python's garbage collector, set for a server that allocates per request.

The rule: what start-up built (modules, the app, the fleet, the policy's tables) is
frozen out of every collection, and the young generation is collected seldom enough
that its cost per request is small, while no request makes a reference cycle, so what a
request allocates is freed by reference counting the moment it ends
(tests/router/test_gc_cycles.py holds the router to 0 cycles per request).

Why: with the interpreter's defaults (700, 10, 10) the router ran a gen-0 collection
every ~26 requests and a full one over the whole heap (~72k start-up objects, every
module and the app) now and then: 96 ms for one pass, and 0.24-0.32 ms of CPU per
request with the KV index on (loadtests/results/kv_events.md). Measured on the router
(`loadtests/results/router_cpu.md`, 2 cores, 6 s of wrk at 32 connections, a zero-cost
echoing sim worker): the defaults spent 315 ms in 332 collections (the longest 96 ms);
frozen with these thresholds, a handful of collections, none over a few ms.

- GEN0 = 20,000: the net count of tracked objects allocated (allocations minus frees)
  between gen-0 collections. A request frees what it allocates, so the count grows only
  by what outlives requests (tree nodes, the per-worker tables' rows), about 25 objects
  a request here: one gen-0 pass per ~800 requests instead of ~26, each over at most
  20k young objects (well under a millisecond).
- GEN1 = 20: gen-1 passes (over what survived gen 0) every 20 gen-0 passes.
- GEN2 = 100: a full pass (all but the frozen) is also held back until the objects
  waiting for it exceed 25% of those already in gen 2 (CPython's own rule), so it stays
  rare as the trees grow; freezing keeps start-up's objects out of it altogether.
"""

from __future__ import annotations

import gc

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
