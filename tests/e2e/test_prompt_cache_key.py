"""`prompt_cache_key` sessions and pins through real processes: a Redis server, three sim
workers, one or two `python -m router serve` replicas, the official openai client.

- A key over 1,024 bytes gets 400 naming the field (OpenAI's error shape).
- Parallel siblings of a session's *first* call (different texts, no prefix known
  anywhere) land on one worker, through one router and through two replicas (each sibling
  alternating), where today's router spreads them by load.
- A pin's TTL over the worker's maximum is clamped, and the answer's usage says so; the
  pin shows in the worker's /metrics and its heartbeat in Redis.
- A session moved off its worker (overloaded) has its pin there released by the router.
- A pin asked through one replica holds a lost session on the other (the pin's TTL
  travels with the session entry).
"""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI
from redis import Redis as SyncRedis

from loadtests.load.cluster import Child, Cluster, WorkerSpec, sim_cluster
from loadtests.load.workloads import words
from shared.procs import http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WORKERS = 3
SESSIONS = 10
SIBLINGS = 4


@pytest.fixture
def fleet() -> Iterator[Cluster]:
    fleet = sim_cluster(WORKERS, WorkerSpec(decode_ms=2.0, heartbeat_s=0.2))
    yield fleet
    fleet.close()


def client(router: Child) -> OpenAI:
    return OpenAI(base_url=router.url + "/v1", api_key="k1", max_retries=0, timeout=30)


def model_of(router: Child) -> str:
    _, body = http_json(router.url + "/v1/models")
    return body["data"][0]["id"]


def call(c: OpenAI, model: str, text: str, key: str | None, **extra: object) -> tuple[str, dict]:
    body: dict[str, object] = dict(extra)
    if key is not None:
        body["prompt_cache_key"] = key
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=4,
        extra_body=body,
    )  # fmt: skip
    reply = raw.parse()
    usage = reply.usage.model_dump() if reply.usage is not None else {}
    return raw.headers["x-radix-worker"], usage


def first_call_siblings(routers: list[Child], keyed: bool) -> list[set[str]]:
    """Each session fans out SIBLINGS calls at once, before any of it is cached; sibling
    i goes through router i mod len(routers). The workers each session's siblings reached."""
    model = model_of(routers[0])
    clients = [client(r) for r in routers]
    placed = []
    with ThreadPoolExecutor(SIBLINGS) as pool:
        for s in range(SESSIONS):
            rng = random.Random(f"s{s}")
            texts = [f"sibling {i}: " + words(rng, 60) for i in range(SIBLINGS)]
            key = f"session-{s}" if keyed else None
            futures = [
                pool.submit(call, clients[i % len(clients)], model, t, key)
                for i, t in enumerate(texts)
            ]
            placed.append({f.result()[0] for f in futures})
    return placed


def test_a_key_over_1024_bytes_is_refused_naming_the_field(fleet: Cluster) -> None:
    router = fleet.start_router({"policy": "cache_aware"})
    c, model = client(router), model_of(router)
    with pytest.raises(openai.BadRequestError) as e:
        call(c, model, "hello", "é" * 513)  # 513 characters, 1,026 bytes
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "prompt_cache_key", err
    assert err["type"] == "invalid_request_error"
    assert call(c, model, "hello", "é" * 512)[0]  # 1,024 bytes: served


def test_first_call_siblings_share_a_worker(fleet: Cluster) -> None:
    router = fleet.start_router({"policy": "cache_aware"})
    placed = first_call_siblings([router], keyed=True)
    assert all(len(workers) == 1 for workers in placed), placed
    # The sessions still spread over the fleet (rendezvous on the key).
    assert len(set().union(*placed)) > 1


def test_siblings_share_a_worker_across_two_replicas(fleet: Cluster) -> None:
    sync = {"policy": "cache_aware", "sync": True, "sync_flush_interval": 0.01}
    a = fleet.start_router(sync)
    b = fleet.add_router("router-b", sync)
    placed = first_call_siblings([a, b], keyed=True)
    assert all(len(workers) == 1 for workers in placed), placed
    # Later calls of every session (its first sibling's context and a tool's output),
    # through either replica, stay there. (A later call whose text no tree holds would
    # be a lost session, which moves: rule 3, router/holdings/sessions.py.)
    model = model_of(a)
    for s, workers in enumerate(placed):
        context = "sibling 0: " + words(random.Random(f"s{s}"), 60)
        for r in (a, b):
            later = f"{context} tool: later call {s} " + "x " * 30
            worker, _ = call(client(r), model, later, f"session-{s}")
            assert {worker} == workers


def test_a_pin_asked_through_one_replica_holds_the_session_on_the_other(fleet: Cluster) -> None:
    """Rule 3 through replicas: a later call whose text no tree holds (a lost session)
    moves, unless a pin still holds the session's context. The pin is asked through
    replica A; replica B knows it only from the session entry the sync carried (with
    its TTL), and keeps the session where A placed it; the same call for a session
    placed without a pin moves. Fails where pins do not travel between replicas."""
    sync = {"policy": "cache_aware", "sync": True, "sync_flush_interval": 0.01}
    a = fleet.start_router(sync)
    b = fleet.add_router("router-b", sync)
    model = model_of(a)
    rng = random.Random(5)
    homes = {}
    for key, extra in (("pinned-1", {"cache_pin_ttl": 60}), ("unpinned-1", {})):
        homes[key], _ = call(client(a), model, f"{key}: " + words(rng, 60), key, **extra)
    time.sleep(1.5)  # past FRESH_S (not a sibling), and the sync has carried both
    for key, stays in (("pinned-1", True), ("unpinned-1", False)):
        worker, _ = call(client(b), model, "unrelated: " + words(rng, 40), key)
        assert (worker == homes[key]) is stays, (key, worker, homes)


def test_unkeyed_siblings_spread_as_today(fleet: Cluster) -> None:
    """The same traffic without keys: cache_aware places the siblings by load, so some
    session's siblings split (what the key fixes)."""
    router = fleet.start_router({"policy": "cache_aware"})
    placed = first_call_siblings([router], keyed=False)
    assert any(len(workers) > 1 for workers in placed), placed


def test_a_ttl_over_the_maximum_is_clamped_and_the_pin_is_reported(fleet: Cluster) -> None:
    router = fleet.start_router({"policy": "cache_aware"})
    c, model = client(router), model_of(router)
    worker, usage = call(c, model, "agent context " * 40, "agent-7", cache_pin_ttl=3600)
    assert usage["cache_pin"] == {"ttl_s": 300.0, "requested_ttl_s": 3600.0, "clamped": True}
    _, usage = call(c, model, "other " * 40, "agent-8", cache_pin_ttl=20)
    assert usage["cache_pin"]["clamped"] is False
    url = fleet.workers[worker].url
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    pinned = [ln for ln in metrics.splitlines() if ln.startswith("radix_worker_pinned_tokens ")]
    assert pinned and float(pinned[0].split()[1]) > 0
    assert fleet.redis is not None
    redis = SyncRedis.from_url(fleet.redis.url)
    try:

        def heartbeat_pins() -> int:
            for key in redis.scan_iter(match="*worker:*"):
                h = redis.hgetall(key)
                if h.get(b"worker_id") == worker.encode():
                    return int(h.get(b"pinned_tokens", b"0"))
            return 0

        wait_until(lambda: heartbeat_pins() > 0, 10)
    finally:
        redis.close()


def pins_at(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return float(next(ln for ln in lines if ln.startswith("radix_worker_pins ")).split()[1])


def test_a_moved_session_has_its_pin_released_on_the_worker_it_left(fleet: Cluster) -> None:
    """The session's worker gets busy (a long stream on it) past the balance rule, so the
    session's next call goes elsewhere; the router tells the old worker to release the
    pin it keeps for that session (POST /release_pin), which would otherwise hold its KV
    for the TTL (60 s) for a call that goes elsewhere. Fails where the router sends none."""
    router = fleet.start_router(
        {"policy": "cache_aware", "balance_abs_threshold": 0, "balance_rel_threshold": 1.0}
    )
    c, model = client(router), model_of(router)
    context = "agent context " * 40
    home, usage = call(c, model, context, "moving-1", cache_pin_ttl=60)
    assert usage["cache_pin"]["ttl_s"] == 60.0
    assert pins_at(fleet.workers[home].url) == 1
    # A long answer on the session's worker (its prefix matches there): load 1 against 0.
    busy = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": context}], max_tokens=4000,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    try:
        next(iter(busy))
        moved, _ = call(c, model, context + " tool: done", "moving-1", cache_pin_ttl=60)
        assert moved != home
        wait_until(lambda: pins_at(fleet.workers[home].url) == 0, 10)
    finally:
        busy.close()
