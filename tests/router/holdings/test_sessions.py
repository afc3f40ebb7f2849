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
    AGREE_MARGIN,
    DIGEST_BYTES,
    FRESH_S,
    PIN_YIELD,
    SessionTable,
    rendezvous,
    select,
    session_digest,
    tenant_of,
)
from router.holdings.sync import DecisionSync
from router.holdings.sync_wire import (
    SEP,
    SESSION_MAX_BYTES,
    SessionEntry,
    decode_session,
    encode_session,
)
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


def test_a_lone_routers_new_session_goes_to_the_least_loaded_worker() -> None:
    """A lone router has no replica to agree with: rule 1's pick is among the least
    loaded workers (strictly), then the fewest sessions, then the key's hash. The
    replicas' rule (the key's top hash among the fewest sessions unless another is over
    AGREE_MARGIN less loaded) bunched long contexts under load: JCT 1.06x today's at 4
    workers, 0.08 sessions/s. Fails with the replicas' rule."""
    d = session_digest("", "s")
    first = rendezvous(d, IDS, [0, 0, 0], 64, 1.5, agree=False)
    assert first == rendezvous(d, IDS, [0, 0, 0], 64, 1.5)  # ties: the key's hash
    loads = [1 if w == first else 0 for w in IDS]
    assert rendezvous(d, IDS, loads, 64, 1.5, agree=False) != first
    # Load before the count: the least loaded worker holds the most sessions.
    active = {"w0": 5, "w1": 1, "w2": 0}
    assert rendezvous(d, IDS, [1, 3, 2], 64, 1.5, active, agree=False) == "w0"
    assert rendezvous(d, IDS, [2, 1, 1], 64, 1.5, active, agree=False) == "w2"
    # Through the session rule: a lone router's table picks by load, a replica's agrees.
    assert not SessionTable(10, 60).agree and SessionTable(10, 60, replicas=True).agree


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
    assert decode_session(encode_session(b"r1" + SEP, "w2", digest)) == (digest, "w2", 0, True)
    kept = decode_session(encode_session(b"r1" + SEP, "w2", b"p" * DIGEST_BYTES, 240.5, False))
    assert kept == SessionEntry(b"p" * DIGEST_BYTES, "w2", 240.5, False)


def test_an_entry_of_the_version_before_pins_is_a_placement() -> None:
    old = b"r1" + SEP + b"w2" + SEP + b"d" * DIGEST_BYTES  # what that version wrote
    assert decode_session(old) == SessionEntry(b"d" * DIGEST_BYTES, "w2", 0.0, True)


def test_an_entry_with_a_later_versions_fields_is_read_for_the_fields_it_knows() -> None:
    """Forward compatibility (sync_wire.py's module doc): fields a later version adds
    after `LATER` are ignored, within the entry's size bound, so a rolling upgrade
    keeps sessions flowing between old and new replicas from this version on."""
    entry = encode_session(b"r1" + SEP, "w2", b"d" * DIGEST_BYTES, 240.5, False)
    for later in (b";zone=eu-west", b";", b";a;b;\x00\xff", b";" + b"9" * 400):
        got = decode_session(entry + later)
        assert got == SessionEntry(b"d" * DIGEST_BYTES, "w2", 240.5, False), later
    with pytest.raises(ValueError, match="too large"):  # the bound covers them too
        decode_session(entry + b";" + b"x" * SESSION_MAX_BYTES)
    with pytest.raises(ValueError, match="pin TTL"):  # the fields it knows still checked
        decode_session(b"r1" + SEP + b"w2" + SEP + b"d" * DIGEST_BYTES + b"k;600")


@pytest.mark.parametrize(
    "tail, why",
    [
        (b"p", "pin TTL"),  # no digits
        (b"p-5", "pin TTL"),
        (b"p1.5", "pin TTL"),
        (b"p86400001", "pin TTL"),  # over the request schema's 86,400 s
        (b"p" + b"9" * 40, "pin TTL"),  # an int() of any length is never built
        ("p１２".encode(), "pin TTL"),  # non-ASCII digits
        (b"x100", "unknown kind"),
    ],
)
def test_a_bad_pin_in_a_session_entry_is_refused(tail: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_session(b"r" + SEP + b"w0" + SEP + b"d" * DIGEST_BYTES + tail)


def test_a_session_entry_is_bounded_before_it_is_parsed() -> None:
    """An entry of the right shape but over SESSION_MAX_BYTES (a long replica id:
    nothing else checks it) is refused whole: fails without the size bound."""
    entry = encode_session(b"r" * 4096 + SEP, "w0", b"d" * DIGEST_BYTES, 10.0)
    assert len(entry) > SESSION_MAX_BYTES
    with pytest.raises(ValueError, match="too large"):
        decode_session(entry)


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
        sync.on_session = table.learn
        made.append((redis, sync, table))
    (ra, a, _), (_, b, table_b) = made
    try:
        await a.start()
        await b.start()
        await asyncio.wait_for(asyncio.gather(a.caught_up.wait(), b.caught_up.wait()), 5)
        # Anyone who can write to Redis can write an entry: a bad one is counted, skipped.
        await ra.xadd(a.registry.decisions_stream, {"s": b"evil" + SEP + b"w1" + SEP + b"x"})
        await ra.xadd(a.registry.decisions_stream, {"s": b"evil" + SEP + b"w1" + SEP + b"x" * 600})
        digest = session_digest(tenant_of("k"), "chat-9")
        a.publish_session("w1", digest)
        await wait_until(lambda: table_b.get(digest, 0) == "w1")
        assert b.rejections.counts.get("sync_sessions", 0) >= 2
        # A call that kept the session with a pin: the other replica learns the pin.
        assert not table_b.held(digest, b.clock() + 2 * FRESH_S)
        a.publish_session("w1", digest, pin_ttl=600.0, placed=False)
        await wait_until(lambda: table_b.held(digest, b.clock() + 2 * FRESH_S))
        # A later version's entry, a field this one does not know after its pin: learned.
        later = session_digest(tenant_of("k"), "chat-10")
        entry = encode_session(b"r9" + SEP, "w2", later, 600.0, True) + b";zone=eu-west"
        await ra.xadd(a.registry.decisions_stream, {"s": entry})
        await wait_until(lambda: table_b.get(later, 0) == "w2")
        assert table_b.held(later, b.clock() + 2 * FRESH_S)
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
    # The session's worker is busier (not overloaded, not past PIN_YIELD): the policy's
    # no_match pick is elsewhere.
    view.loads[IDS.index(first.worker_id)] = PIN_YIELD
    return routing, table, view, first.worker_id


def test_a_lost_session_moves_and_a_pinned_or_fresh_one_stays() -> None:
    """Rule 3: the router's tree holds nothing of the call anywhere (no_match) after a
    tool gap with no pin: the session moves, to rule 1's pick (the worker holding the
    fewest active sessions: here the one holding neither session), instead of staying
    on a worker that has let its context go. A pin that has not run out, or a sibling
    within FRESH_S of the call that placed it, keeps it. Fails on the rule without 3
    (the session always stays)."""
    d = session_digest("", "s")
    forgotten = RouteRequest("user: nothing the tree has seen " * 20)
    routing, table, view, home = _placed(pin_ttl=0.0)
    odd = RouteRequest("subtask: " + "unseen words " * 40)
    sibling, _, _ = select(table, routing, odd, view, FRESH_S / 2, d, 64, 1.5)
    assert sibling.worker_id == home  # a sibling: fresh, kept
    other = table.get(session_digest("", "o"), 10.0)
    (free,) = set(IDS) - {home, other}
    later, moved, left = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
    assert moved and later.worker_id == free
    assert left == home  # the caller releases the session's pin there
    assert table.get(d, 10.0) == later.worker_id and table.lost == 1

    routing, table, view, home = _placed(pin_ttl=30.0)
    later, moved, left = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
    assert not moved and left is None
    assert later.worker_id == home and later.reason == "session"  # pinned
    # That call asked for no pin: at t=20, with nothing of the call in any tree, it moves.
    after, moved, _ = select(table, routing, odd, view, 20.0, d, 64, 1.5)
    assert moved and after.worker_id != home


def test_a_pinned_lost_session_yields_a_busy_worker() -> None:
    """Rule 3's yield: the tree holds nothing of the call and the session asked for a
    pin, but its worker is busier than the least loaded by more than PIN_YIELD (and
    the balance ratio): the pin may have been refused or released, and the queue
    there costs the call either way, so the session moves (and its pin there is
    released). Fails without the yield (a believed pin always held the session)."""
    d = session_digest("", "s")
    forgotten = RouteRequest("user: nothing the tree has seen " * 20)
    routing, table, view, home = _placed(pin_ttl=30.0)
    view.loads[IDS.index(home)] = PIN_YIELD + 1
    later, moved, left = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
    assert moved and later.worker_id != home and left == home
    # A sibling of that move (fresh) follows it, whatever the loads.
    odd = RouteRequest("subtask: " + "unseen words " * 40)
    sibling, moved, _ = select(table, routing, odd, view, 10.0 + FRESH_S / 2, d, 64, 1.5)
    assert not moved and sibling.worker_id == later.worker_id


def _two_replicas(pin_ttl: float) -> tuple[list[tuple[object, SessionTable]], str]:
    """Two replicas (a routing and a session table each) that share, as the sync does,
    the placement of one keyed session (and a second session) at t=0 and its pin."""
    replicas = [
        (
            build_routing(RouterConfig(policy="cache_aware"), random.Random(r)),
            SessionTable(100, 600, replicas=True),
        )
        for r in range(2)
    ]  # fmt: skip
    view = FleetView(IDS, capacities=(100_000,) * 3)
    (routing_a, table_a), (routing_b, table_b) = replicas
    for key, text, ttl in (
        ("s", "system: a long context " + "tools and repository " * 50, pin_ttl),
        ("o", "system: another session " + "unrelated words " * 80, 0.0),
    ):
        d = session_digest("", key)
        decision, placed, _ = select(
            table_a, routing_a, RouteRequest(text), view, 0.0, d, 64, 1.5,
            pin_ttl=ttl,
        )  # fmt: skip
        assert placed
        routing_b.observe(decision.worker_id, text, 0.0)
        table_b.learn(SessionEntry(d, decision.worker_id, ttl, placed), 0.0)
    return replicas, table_a.get(session_digest("", "s"), 0.0)  # type: ignore[return-value]


def test_replicas_move_a_lost_session_to_one_worker_and_keep_a_pinned_one() -> None:
    """Rule 3 through replicas: a lost session's siblings reach both replicas at once,
    each with its own load view (the policy's no_match picks differ), and both move it
    to the key's rendezvous pick. A pin asked on one replica holds the session on the
    other (the pin travels with the session entry): fails if `learn` drops the TTL."""
    d = session_digest("", "s")
    forgotten = RouteRequest("user: nothing the tree has seen " * 20)
    replicas, home = _two_replicas(pin_ttl=0.0)
    picks = []
    for r, (routing, table) in enumerate(replicas):
        view = FleetView(IDS, capacities=(100_000,) * 3)
        # Each replica's own view: the policy's no_match pick (least loaded) is w0 on
        # one, w2 on the other.
        view.loads[:] = [0, 2, 3] if r == 0 else [3, 2, 0]
        decision, moved, _ = select(table, routing, forgotten, view, 10.0, d, 64, 1.5)
        assert moved and table.lost == 1
        picks.append(decision.worker_id)
    assert picks[0] == picks[1]

    replicas, home = _two_replicas(pin_ttl=30.0)
    routing_b, table_b = replicas[1]
    view = FleetView(IDS, capacities=(100_000,) * 3)
    view.loads[:] = [3 if w == home else 0 for w in IDS]
    kept, moved, _ = select(table_b, routing_b, forgotten, view, 10.0, d, 64, 1.5)
    assert not moved and kept.worker_id == home and kept.reason == "session"


def test_a_replicas_stale_keep_does_not_undo_a_move() -> None:
    """A keep (`placed` False) naming another worker than the table's crossed a move in
    the stream: ignored, so the replicas do not swap workers for the session; a
    placement always wins, and a keep on the same worker refreshes the pin."""
    d = session_digest("", "s")
    table = SessionTable(100, 600)
    table.put(d, "w2", 10.0)  # this replica moved the session to w2
    table.learn(SessionEntry(d, "w1", 60.0, placed=False), 10.1)  # another's keep on w1
    assert table.get(d, 11.0) == "w2" and not table.held(d, 20.0)
    table.learn(SessionEntry(d, "w2", 60.0, placed=False), 12.0)
    assert table.held(d, 50.0)
    table.learn(SessionEntry(d, "w0", 0.0, placed=True), 13.0)
    assert table.get(d, 14.0) == "w0"


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
    routing = build_routing(RouterConfig(policy="cache_aware"), random.Random(0))
    view = FleetView(ids, capacities=(100_000,) * 4)
    table = SessionTable(100, 600)
    placed = []
    for i in range(12):
        text = RouteRequest(f"system: session {i} " + f"context{i} words " * 60)
        decision, _, _ = select(
            table, routing, text, view, float(i), session_digest("", f"agent-{i}"), 64, 1.5
        )
        placed.append(decision.worker_id)
    assert sorted(placed.count(w) for w in ids) == [3, 3, 3, 3]
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


def _scan(table: SessionTable, now: float) -> dict[str, int]:
    """The plain count the table keeps incrementally: every live entry used within ACTIVE_S."""
    counts: dict[str, int] = {}
    for wid, used, _ in table._entries.values():
        if now - used <= ACTIVE_S:
            counts[wid] = counts.get(wid, 0) + 1
    return counts


def test_the_active_count_is_kept_as_a_scan_would_count() -> None:
    """`active` reads counts kept as entries are put, moved, aged out, dropped by the
    LRU bound or expired by `get`: after every step they equal a full scan's."""
    rng = random.Random(7)
    table = SessionTable(max_entries=60, ttl=500.0)
    keys = [session_digest("", f"k{i}") for i in range(100)]
    now = 0.0
    for _ in range(5000):
        now += rng.expovariate(1 / 4.0)
        d = rng.choice(keys)
        what = rng.random()
        if what < 0.6:
            table.put(d, rng.choice(IDS), now, pin_ttl=rng.choice((0.0, 30.0)))
        elif what < 0.75:
            table.learn(SessionEntry(d, rng.choice(IDS), 10.0, rng.random() < 0.5), now)
        else:
            table.get(d, now)  # may expire the entry
        assert table.active(now) == _scan(table, now)
    assert len(table) <= 60


def test_counting_active_sessions_does_not_read_the_table() -> None:
    """A first call's count costs the same however many sessions the table holds: it
    reads only the entries leaving the window since the last count (fails on a scan)."""
    table = SessionTable(max_entries=100_000, ttl=3600)
    for i in range(50_000):
        table.put(b"s%d" % i, IDS[i % 3], now=10.0)
    assert table.active(20.0) == {w: 50_000 // 3 + (i < 50_000 % 3) for i, w in enumerate(IDS)}
    table._entries = _Unread(table._entries)  # a scan would read every entry
    assert table.active(30.0)["w0"] == 16_667
    assert table._entries.reads == 1  # only the oldest, to see it is still active


class _Unread(dict):
    """The table's entries, counting the values read."""

    def __init__(self, entries: dict) -> None:
        super().__init__(entries)
        self.reads = 0

    def __getitem__(self, key: bytes) -> tuple[str, float, float]:
        self.reads += 1
        return super().__getitem__(key)

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the whole table read")
