"""`radix-router serve --processes 2`: two router processes behind one port route as one.

Every service is a real process: Redis, two sim workers, the supervising router and its
two children. Each request below opens a fresh connection, so the kernel's SO_REUSEPORT
hash spreads them over both children; the follow-ups of one system prompt still all
reach the worker that took the first (a child that had not seen it would answer
`no_match`), which is the replica sync between the children at work.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster
from loadtests.load.workloads import words
from shared.procs import http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def fleet() -> Iterator[Cluster]:
    fleet = sim_cluster(2, WorkerSpec(decode_ms=0.0, heartbeat_s=0.2))
    yield fleet
    fleet.close()


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def ask(url: str, prompt: str) -> tuple[str, str]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=f'{{"prompt": "{prompt}", "max_tokens": 2}}'.encode(),
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers["x-radix-worker"], r.headers["x-radix-route-reason"]


def test_two_processes_share_one_port_and_their_routing_decisions(fleet: Cluster) -> None:
    router = fleet.start_router({"processes": 2, "sync_flush_interval": 0.01})
    routers = [p for p in children(router.pid) if Path(f"/proc/{p}/cmdline").exists()]
    assert len(routers) >= 2  # the two routers (plus multiprocessing's resource tracker)
    # start_router waited for one child to see both workers; now every child does.
    wait_until(lambda: all(fleet.routable() == 2 for _ in range(8)), 30, router)
    system = words(random.Random(7), 300)
    first, reason = ask(router.url, system + " q0")
    assert reason == "no_match"

    # Both children have applied the first decision once every answer names one tree.
    def synced() -> bool:
        views = [http_json(router.url + "/workers")[1]["data"] for _ in range(8)]
        return all(
            next(w["tree"].get("tree_chars", 0) for w in v if w["worker_id"] == first) > 0
            for v in views
        )

    wait_until(synced, 30, router)
    for i in range(1, 12):
        assert ask(router.url, system + f" q{i}") == (first, "cache_hit")
