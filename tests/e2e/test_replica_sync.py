"""Two router replicas route as one through Redis (router/holdings/sync.py), every service a real
process: a Redis server, three sim workers, two `python -m router serve` replicas.

Conversations follow a fixed schedule: turn t of conversation k goes through replica
(k + t) mod 2, so every conversation alternates between the replicas and each replica
sees the first turn of only half of them (as behind a Kubernetes Service). Between
rounds the sync-on tests wait until both replicas hold the same prefix trees (GET
/workers, `tree`), which is what "the decision reached the other replica" means; no
test sleeps for a fixed time or asserts one.
"""

from __future__ import annotations

import random
import re
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from openai import OpenAI
from redis import Redis as SyncRedis

from loadtests.load.cluster import (
    START_TIMEOUT_S,
    Child,
    Cluster,
    WorkerSpec,
    sim_cluster,
    wait_health,
)
from loadtests.load.workloads import words
from shared.procs import http_json, wait_until
from shared.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

WORKERS = 3
CONVERSATIONS = 12
SYNC = {"sync": True, "sync_flush_interval": 0.01, "sync_load_interval": 0.1}


@dataclass
class Replica:
    """One router process; `restart` keeps its port, as a restarted pod behind a Service."""

    child: Child
    fleet: Cluster  # stops the replica's process with its own
    client: OpenAI | None = None

    def openai(self) -> OpenAI:
        # The URL survives a restart (same port), and so may the client.
        if self.client is None:
            self.client = OpenAI(
                base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30
            )
        return self.client

    @property
    def url(self) -> str:
        return self.child.url

    def trees(self) -> dict[str, int]:
        """Characters in this replica's prefix tree per worker (its view of every cache)."""
        status, body = http_json(self.url + "/workers", timeout=2.0)
        assert status == 200, body
        return {w["worker_id"]: w["tree"].get("tree_chars", 0) for w in body["data"]}

    def routable(self) -> int:
        try:
            status, body = http_json(self.url + "/workers", timeout=2.0)
        except OSError:
            return 0
        if status != 200:
            return 0
        return sum(1 for w in body["data"] if w["breaker"] != "open" and not w["draining"])

    def restart(self) -> None:
        self.child.stop(grace_s=5)
        old = self.child
        self.child = self.fleet.adopt(old.fresh().start())
        wait_health(self.child)


def start_replica(fleet: Cluster, name: str, settings: dict[str, object]) -> Replica:
    assert fleet.redis is not None
    port = free_port()
    args = ["router", "serve", "--host", "127.0.0.1", "--port", str(port), "--policy",
            "cache_aware", "--redis-url", fleet.redis.url, "--log-level", "WARNING"]  # fmt: skip
    base = {"discovery_interval": 0.2, "retry_backoff": 0.01, **settings}
    env = {f"RADIX_ROUTER_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in base.items()}  # fmt: skip
    child = Child(name, args, f"http://127.0.0.1:{port}", fleet.log_dir / f"{name}.log", env)
    replica = Replica(fleet.adopt(child.start()), fleet)
    wait_until(lambda: replica.routable() == WORKERS, START_TIMEOUT_S, replica.child)
    return replica


@dataclass
class Conversation:
    """A multi-turn chat sent through the official openai client, one turn at a time."""

    seed: int
    messages: list[dict[str, str]] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def turn(self, replica: Replica, model: str) -> None:
        rng = random.Random(f"conv:{self.seed}:{len(self.messages)}")
        if not self.messages:  # a system prompt of its own: no prefix shared across chats
            self.messages.append({"role": "system", "content": words(rng, 120)})
        self.messages.append({"role": "user", "content": words(rng, 24)})
        raw = replica.openai().chat.completions.with_raw_response.create(
            model=model,
            messages=self.messages,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        reply = raw.parse()
        self.workers.append(raw.headers["x-radix-worker"])
        self.reasons.append(raw.headers["x-radix-route-reason"])
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        self.cached.append(usage.prompt_tokens_details.cached_tokens or 0)
        self.messages.append(
            {"role": "assistant", "content": reply.choices[0].message.content or ""}
        )

    @property
    def stayed(self) -> int:
        """Follow-up turns that reached the worker holding turn 1's cache."""
        return sum(1 for w in self.workers[1:] if w == self.workers[0])


@pytest.fixture
def fleet() -> Iterator[Cluster]:
    # No decode cost: requests are sequential here, load never tips the rule.
    fleet = sim_cluster(WORKERS, WorkerSpec(decode_ms=0.0, heartbeat_s=0.2))
    yield fleet
    fleet.close()  # the replicas too: each was adopted by the fleet


def model_of(replica: Replica) -> str:
    _, body = http_json(replica.url + "/v1/models")
    return body["data"][0]["id"]


def converge(a: Replica, b: Replica, timeout: float = 20.0) -> None:
    """Wait until both replicas hold the same non-empty trees (every decision applied)."""

    def same() -> bool:
        ta, tb = a.trees(), b.trees()
        return ta == tb and any(ta.values())

    wait_until(same, timeout, a.child)


def rounds(
    convs: list[Conversation], replicas: list[Replica], turns: range, model: str,
    barrier: bool,
) -> None:  # fmt: skip
    for t in turns:
        for conv in convs:
            conv.turn(replicas[(conv.seed + t) % len(replicas)], model)
        if barrier:
            converge(replicas[0], replicas[1])


def test_alternating_turns_stay_on_one_worker_with_sync(fleet: Cluster) -> None:
    a, b = start_replica(fleet, "router-a", SYNC), start_replica(fleet, "router-b", SYNC)
    convs = [Conversation(k) for k in range(CONVERSATIONS)]
    rounds(convs, [a, b], range(4), model_of(a), barrier=True)
    for conv in convs:
        assert conv.workers == [conv.workers[0]] * 4, conv.workers
        assert conv.reasons[1:] == ["cache_hit"] * 3, conv.reasons
        # The worker finds more of each turn in its KV cache than of the one before.
        assert conv.cached[1] > 0 and conv.cached[1:] == sorted(set(conv.cached[1:])), conv.cached
    print(f"\n[sync on] follow-up turns on turn 1's worker: "
          f"{sum(c.stayed for c in convs)}/{3 * len(convs)}")  # fmt: skip


def test_without_sync_alternating_turns_lose_their_worker(fleet: Cluster) -> None:
    off = {"sync": False}
    a, b = start_replica(fleet, "router-a", off), start_replica(fleet, "router-b", off)
    convs = [Conversation(k) for k in range(CONVERSATIONS)]
    rounds(convs, [a, b], range(4), model_of(a), barrier=False)
    stayed = sum(c.stayed for c in convs)
    print(f"\n[sync off] follow-up turns on turn 1's worker: {stayed}/{3 * len(convs)}")
    # Turn 2 reaches a replica that never saw turn 1, so it is placed with no match and
    # stays only by chance (~1 in 3); each replica then keeps its own turns together
    # (3 follows 1, 4 follows 2). Replaying this schedule through the real policy 3,000
    # times with different tie-breaks kept on average 20.5 of 36 follow-ups and never more
    # than 32, so "at least 4 moved" does not flake, and sync on keeps all 36.
    assert [c.reasons[1] for c in convs] == ["no_match"] * len(convs)
    assert stayed <= 3 * len(convs) - 4, [c.workers for c in convs]


def test_restarted_replica_recovers_affinity_from_the_stream(fleet: Cluster) -> None:
    a, b = start_replica(fleet, "router-a", SYNC), start_replica(fleet, "router-b", SYNC)
    model = model_of(a)
    convs = [Conversation(k) for k in range(CONVERSATIONS)]
    rounds(convs, [a, b], range(2), model, barrier=True)
    b.restart()
    wait_until(lambda: b.routable() == WORKERS, START_TIMEOUT_S, b.child)
    # Before it routes anything, the restarted replica rebuilt every tree from the stream.
    converge(a, b)
    for conv in convs:
        conv.turn(b, model)
        assert conv.workers[-1] == conv.workers[0], conv.workers
        assert conv.reasons[-1] == "cache_hit"


def test_redis_loss_degrades_per_replica_and_sync_resumes(fleet: Cluster) -> None:
    assert fleet.redis is not None
    a, b = start_replica(fleet, "router-a", SYNC), start_replica(fleet, "router-b", SYNC)
    model = model_of(a)
    warm = [Conversation(k) for k in range(4)]
    rounds(warm, [a, b], range(1), model, barrier=True)
    # Both have read every decision before Redis goes: one still in the stream when it
    # stops is lost with it (the new Redis is empty), which is not what this tests.
    converge(a, b)

    fleet.redis.stop()
    # Per-replica routing: each replica keeps routing (no error) and keeps its own
    # conversations together, with the fleet it last knew.
    pinned: list[tuple[Conversation, Replica]] = [
        (Conversation(100 + k), (a, b)[k % 2]) for k in range(4)
    ]
    for _ in range(3):
        for conv, replica in pinned:
            conv.turn(replica, model)  # raises on any non-200 answer
    for conv, _ in pinned:
        assert conv.workers == [conv.workers[0]] * 3, conv.workers
    for conv in warm:  # turn 2 of chats that started before the outage, on either replica
        conv.turn((a, b)[(conv.seed + 1) % 2], model)
        assert conv.workers[1] == conv.workers[0], conv.workers

    fleet.redis.start()
    wait_until(lambda: a.routable() == WORKERS and b.routable() == WORKERS, 20, a.child)
    # The decisions each replica buffered during the outage reach the other one.
    converge(a, b)
    for conv, replica in pinned:
        conv.turn(b if replica is a else a, model)
        assert conv.workers[-1] == conv.workers[0], conv.workers
    # And new decisions flow again: a conversation started on A is found by B.
    fresh = Conversation(200)
    fresh.turn(a, model)
    converge(a, b)
    fresh.turn(b, model)
    assert fresh.workers[1] == fresh.workers[0] and fresh.reasons[1] == "cache_hit"


def test_with_a_tokenizer_replicas_share_token_ids(fleet: Cluster) -> None:
    """With `tokenizer` the trees key on the prompt ids, and replicas share ids (issue 26:
    they shared text, which a tree on tokens could not use, so turn 2 on the other
    replica found no match). A foreign tokenizer's entry is dropped and counted."""
    assert fleet.redis is not None
    tokens = {**SYNC, "tokenizer": "sim"}
    a, b = start_replica(fleet, "router-a", tokens), start_replica(fleet, "router-b", tokens)
    convs = [Conversation(k) for k in range(6)]
    rounds(convs, [a, b], range(3), model_of(a), barrier=True)
    for conv in convs:
        assert conv.workers == [conv.workers[0]] * 3, conv.workers
        assert conv.reasons[1:] == ["cache_hit"] * 2, conv.reasons
        assert conv.cached[1] > 0, conv.cached

    # What a replica with another tokenizer (or anyone with write access) would write.
    foreign = b"other\x00w-foreign\x00T0123456789abcdef:" + zlib.compress(b"\x01\x00\x00\x00")
    with SyncRedis.from_url(fleet.redis.url) as raw:
        raw.xadd("radixrouter:decisions", {"d": foreign})

    def rejected(replica: Replica) -> float:
        with urllib.request.urlopen(replica.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        found = re.search(
            r'radix_router_untrusted_rejected_total\{source="sync_decisions"\} (\S+)', text
        )
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: rejected(a) == 1.0 and rejected(b) == 1.0, 20, a.child)
    for replica in (a, b):
        _, body = http_json(replica.url + "/workers")
        assert "w-foreign" not in {w["worker_id"] for w in body["data"]}
        assert all("w-foreign" not in str(w["tree"]) for w in body["data"])
