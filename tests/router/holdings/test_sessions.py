"""The session table (router/holdings/sessions.py) and its replica-sync entries, and session
entries travelling between two replicas over a real Redis server."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from router.fleet.view import FleetView
from router.holdings.prediction import RouteRequest
from router.holdings.sessions import (
    ACTIVE_S,
    ACTIVE_SCAN,
    AGREE_MARGIN,
    DIGEST_BYTES,
    FRESH_S,
    SessionTable,
    rendezvous,
    select,
    session_digest,
    tenant_of,
)
from router.holdings.sync import DecisionSync
from router.holdings.sync_wire import SEP, decode_session, encode_session
from router.policy import build_routing
from shared.config import RouterConfig
from shared.redis_server import RedisServer
from shared.wire.registry import Registry
from tests.waiting import wait_until

IDS = ("w0", "w1", "w2")


def test_keys_are_namespaced_by_tenant() -> None:
    a, b = tenant_of("key-of-tenant-a"), tenant_of("key-of-tenant-b")
    assert a != b and "key-of" not in a  # the API key itself is never kept
    assert session_digest(a, "chat-1") != session_digest(b, "chat-1")
    assert len(session_digest(a, "x" * 5000)) == DIGEST_BYTES  # bounded whatever is sent


def test_the_session_stays_unless_its_worker_is_overloaded_or_gone() -> None:
    table = SessionTable(max_entries=10, ttl=60)
    d = session_digest("", "s")
    assert table.pick(d, IDS, [0, 0, 0], 0, 64, 1.5) is None  # first call: the policy's
    table.put(d, "w1", 0)
    assert table.pick(d, IDS, [0, 40, 0], 1, 64, 1.5) == "w1"  # busy, not overloaded
    assert table.pick(d, IDS, [0, 100, 0], 2, 64, 1.5) is None  # overloaded: moves
    assert table.pick(d, ("w0", "w2"), [0, 0], 3, 64, 1.5) is None  # gone
    assert table.moved == 2


def test_the_table_is_bounded_and_entries_age_out() -> None:
    table = SessionTable(max_entries=3, ttl=10)
    digests = [session_digest("", f"s{i}") for i in range(5)]
    for i, d in enumerate(digests):
        table.put(d, "w0", float(i))
    assert len(table) == 3 and table.get(digests[0], 4) is None  # least recently used
    assert table.get(digests[4], 14) == "w0"
    assert table.get(digests[4], 25) is None  # 11 s after its last use


def test_rendezvous_agrees_across_replicas_and_skips_overloaded_workers() -> None:
    d = session_digest("", "s")
    first = rendezvous(d, IDS, [0, 0, 0], 64, 1.5)
    assert rendezvous(d, IDS, [0, 0, 0], 64, 1.5) == first
    loads = [200 if w == first else 0 for w in IDS]
    assert rendezvous(d, IDS, loads, 64, 1.5) != first
    spread = {rendezvous(session_digest("", f"k{i}"), IDS, [0, 0, 0], 64, 1.5) for i in range(50)}
    assert spread == set(IDS)


def test_rendezvous_takes_the_less_loaded_of_the_keys_top_two() -> None:
    d = session_digest("", "s")
    first = rendezvous(d, IDS, [0, 0, 0], 64, 1.5)
    busy = [AGREE_MARGIN + 1 if w == first else 0 for w in IDS]  # over the margin
    second = rendezvous(d, IDS, busy, 64, 1.5)
    assert second != first
    # The third-ranked worker is never taken while the top two are not overloaded.
    third = next(w for w in IDS if w not in (first, second))
    loads = [0 if w == third else AGREE_MARGIN + 1 for w in IDS]
    assert rendezvous(d, IDS, loads, 64, 1.5) == first


@pytest.mark.parametrize(
    "entry, why",
    [
        (b"r" + SEP + b"w0" + SEP + b"short", "digest"),
        (b"r" + SEP + b"w 0!" + SEP + b"x" * DIGEST_BYTES, "worker id"),
        (b"r" + SEP + b"w0" + SEP + b"x" * 600, "too large"),
        (b"no separators", "malformed"),
        ("not bytes", "too large"),
    ],
)
def test_a_bad_session_entry_is_refused(entry: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_session(entry)


def test_a_digest_holding_separators_round_trips() -> None:
    digest = SEP * DIGEST_BYTES
    assert decode_session(encode_session(b"r1" + SEP, "w2", digest)) == (digest, "w2")


async def test_sessions_reach_the_other_replica_and_garbage_is_counted(
    redis_server: RedisServer,
) -> None:
    config = RouterConfig(sync=True, sync_flush_interval=0.005, sync_load_interval=0.05)
    made = []
    for _ in range(2):
        redis = Redis.from_url(redis_server.url, socket_timeout=5)
        sync = DecisionSync(
            redis, Registry(redis, "t:"), config, observe=lambda w, k, now: None,
            local_inflight=dict,
        )  # fmt: skip
        table = SessionTable(100, 60)
        sync.on_session = table.put
        made.append((redis, sync, table))
    (ra, a, _), (_, b, table_b) = made
    try:
        await a.start()
        await b.start()
        await asyncio.wait_for(asyncio.gather(a.caught_up.wait(), b.caught_up.wait()), 5)
        # Anyone who can write to Redis can write an entry: a bad one is counted, skipped.
        await ra.xadd(a.registry.decisions_stream, {"s": b"evil" + SEP + b"w1" + SEP + b"x"})
        digest = session_digest(tenant_of("k"), "chat-9")
        a.publish_session("w1", digest)
        await wait_until(lambda: table_b.get(digest, 0) == "w1")
        assert b.rejections.counts.get("sync_sessions", 0) >= 1
    finally:
        for redis, sync, _ in made:
            await sync.stop()
            await redis.aclose()


def test_a_load_difference_within_the_margin_keeps_the_top_worker() -> None:
    """Two replicas' views of the loads differ by the requests not yet synced: within
    AGREE_MARGIN they still pick the same worker for a key."""
    d = session_digest("", "s")
    first = rendezvous(d, IDS, [0, 0, 0], 64, 1.5)
    for extra in range(AGREE_MARGIN + 1):
        loads = [extra if w == first else 0 for w in IDS]
        assert rendezvous(d, IDS, loads, 64, 1.5) == first


def _placed(pin_ttl: float) -> tuple[object, SessionTable, FleetView, str]:
    """A cache_aware routing with one keyed session placed at t=0 (its context in the
    router's tree of its worker only), that worker the busiest."""
    routing = build_routing(RouterConfig(policy="cache_aware"), random.Random(0))
    view = FleetView(IDS, capacities=(100_000,) * 3)
    table = SessionTable(100, 600)
    d = session_digest("", "s")
    context = "system: a long context " + "tools and repository " * 50
    first, placed, _ = select(table, routing, RouteRequest(context), view, 0.0, d, 64, 1.5,
                           pin_ttl=pin_ttl)  # fmt: skip
    assert placed
    other = "system: another session " + "unrelated words " * 80
    select(table, routing, RouteRequest(other), view, 0.0, session_digest("", "o"), 64, 1.5)
    # The session's worker is busier (not overloaded): the policy's no_match pick is elsewhere.
    view.loads[IDS.index(first.worker_id)] = 3
    return routing, table, view, first.worker_id


def test_a_lost_session_follows_the_policy_and_a_pinned_or_fresh_one_stays() -> None:
    """Rule 3: the router's tree holds nothing of the call anywhere (no_match) after a
    tool gap with no pin: the session moves to the policy's no_match pick (the least
    loaded worker) instead of staying on a worker that has let its context go. A pin that has not
    run out, or a sibling within FRESH_S of the call that placed it, keeps it. Fails on
    the rule without 3 (the session always stays)."""
    d = session_digest("", "s")
    forgotten = RouteRequest("user: nothing the tree has seen " * 20)
    routing, table, view, home = _placed(pin_ttl=0.0)
    odd = RouteRequest("subtask: " + "unseen words " * 40)
    sibling, _, _ = select(table, routing, odd, view, FRESH_S / 2, d, 64, 1.5)
    assert sibling.worker_id == home  # a sibling: fresh, kept
    later, moved, left = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
    assert moved and later.reason == "no_match" and later.worker_id != home
    assert left == home  # the caller releases the session's pin there
    assert table.get(d, 10.0) == later.worker_id and table.lost == 1

    routing, table, view, home = _placed(pin_ttl=30.0)
    later, moved, left = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
    assert not moved and left is None
    assert later.worker_id == home and later.reason == "session"  # pinned
    # That call asked for no pin: at t=20, with nothing of the call in any tree, it moves.
    after, moved, _ = select(table, routing, odd, view, 20.0, d, 64, 1.5)
    assert moved and after.worker_id != home


def test_a_session_whose_context_the_tree_holds_stays() -> None:
    routing, table, view, home = _placed(pin_ttl=0.0)
    d = session_digest("", "s")
    grown = RouteRequest("system: a long context " + "tools and repository " * 50 + "tool: ok")
    later, moved, left = select(table, routing, grown, view, 10.0, d, 64, 1.5)
    assert not moved and left is None and later.worker_id == home


def test_new_sessions_spread_by_the_sessions_each_worker_holds() -> None:
    """A new session with no cached prefix (one router or replicas) takes the key's
    rendezvous pick among the workers holding the fewest active sessions. Between tool
    gaps the loads (requests in flight) are 0, so through replicas the pick used to be
    the hash alone: 12 sessions on 4 workers put 6 on one (its KV short, hit after the
    first call 0.845 through 2 replicas against 0.901 on one router). Fails on replicas
    without the count."""
    ids = ("w0", "w1", "w2", "w3")
    for agree in (True, False):
        routing = build_routing(RouterConfig(policy="cache_aware"), random.Random(0))
        view = FleetView(ids, capacities=(100_000,) * 4)
        table = SessionTable(100, 600)
        placed = []
        for i in range(12):
            text = RouteRequest(f"system: session {i} " + f"context{i} words " * 60)
            decision, _, _ = select(
                table, routing, text, view, float(i), session_digest("", f"agent-{i}"),
                64, 1.5, agree=agree,
            )  # fmt: skip
            placed.append(decision.worker_id)
        assert sorted(placed.count(w) for w in ids) == [3, 3, 3, 3], agree
    # A second replica with the same table (the sync carries placements) picks the same
    # worker for the next session's first siblings.
    other = SessionTable(100, 600)
    for i, wid in enumerate(placed):
        other.put(session_digest("", f"agent-{i}"), wid, float(i))
    d, loads = session_digest("", "agent-12"), [0, 0, 0, 0]
    assert rendezvous(d, ids, loads, 64, 1.5, table.active(12.0)) == rendezvous(
        d, ids, loads, 64, 1.5, other.active(12.0)
    )


def test_sessions_idle_past_the_active_window_are_not_counted() -> None:
    table = SessionTable(100, 3600)
    table.put(session_digest("", "old"), "w0", 0.0)
    table.put(session_digest("", "new"), "w1", ACTIVE_S)
    assert table.active(ACTIVE_S + 1) == {"w1": 1}


def test_an_overloaded_worker_with_the_fewest_sessions_is_passed_over() -> None:
    d = session_digest("", "s")
    active = {"w0": 0, "w1": 2, "w2": 1}
    assert rendezvous(d, IDS, [0, 0, 0], 64, 1.5, active) == "w0"
    assert rendezvous(d, IDS, [200, 0, 0], 64, 1.5, active) == "w2"  # w0 overloaded


def test_counting_active_sessions_looks_at_the_newest_few_only() -> None:
    """Fresh keys make every call a session's first, each counting active sessions: the
    count reads at most ACTIVE_SCAN entries, the newest, however many the table holds."""
    table = SessionTable(max_entries=4 * ACTIVE_SCAN, ttl=600)
    for i in range(3 * ACTIVE_SCAN):
        table.put(b"old%d" % i, "w0", now=10.0)
    for i in range(ACTIVE_SCAN):
        table.put(b"new%d" % i, "w1", now=20.0)
    assert table.active(now=30.0) == {"w1": ACTIVE_SCAN}
