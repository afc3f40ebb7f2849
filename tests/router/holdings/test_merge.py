"""Routing with the exact index beside the tree (router/holdings/merge.py): decisions.

The real feed object and its real block index, fed real BlockStored events; what a
Redis stream would deliver is applied directly (reading the streams, trust and gaps:
test_kv_feed.py). Times are the policy's `now`, not the wall clock.
"""

from __future__ import annotations

import random

import pytest

from router.holdings.kv_feed import KvEventFeed, StreamState
from router.holdings.kv_index import BlockIndex
from router.policy import build_routing
from router.policy.base import FleetView, RouteRequest
from router.routing import Routing
from shared.config import RouterConfig
from shared.wire.kv_events import BlockRemoved, BlockStored

BLOCK = 16
PREFIX = tuple(range(1000, 2042))  # 1,042 tokens: 65 whole blocks (1,040) and a tail of 2


def request(suffix: int, *prefix: int) -> RouteRequest:
    ids = (*(prefix or PREFIX), suffix, suffix + 1, suffix + 2)
    return RouteRequest("", tokens=ids, model="m")


def feed_holding(held: dict[str, int]) -> KvEventFeed:
    """A feed whose every worker is trusted and holds the first `held[w]` tokens of PREFIX."""
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # no stream is read here
    index = feed.indexes["m"] = BlockIndex(BLOCK)
    for w, n in held.items():
        feed.streams[w] = StreamState("m", 1.0, status="ok")
        blocks = n // BLOCK
        if blocks:
            stored = BlockStored(tuple(range(1, blocks + 1)), None, PREFIX[: blocks * BLOCK], BLOCK)
            index.apply(w, [stored])
    return feed


def policy(name: str, feed: KvEventFeed | None) -> Routing:
    """The room (with the index `feed`, its in-flight window 2 s) and the policy `name`."""
    config = RouterConfig(policy=name, tokenizer="sim", kv_events_inflight=2.0)
    return build_routing(config, random.Random(0), feed=feed)


def warm(p: Routing, fleet: FleetView) -> None:
    """w0 got the prefix 10 s ago (its tree entry is past the in-flight window), w1
    0.5 s ago (in flight), as the routes of a replicated shared prefix leave them."""
    fleet.loads[:] = [0, 100]  # each route goes where the test wants it: w1 overloaded
    assert p.select(request(1), fleet, 0.0).worker_id == "w0"
    fleet.loads[:] = [100, 0]  # w0 overloaded: both policies balance
    assert p.select(request(3), fleet, 9.5).worker_id == "w1"


@pytest.mark.parametrize("name", ["cache_aware", "cost_aware"])
def test_a_holder_the_index_confirms_ranks_as_the_tree_ranks_it(name: str) -> None:
    """Both workers hold the whole prefix, w1 is busier. The index sees w0's 65 whole
    blocks (1,040 tokens), the tree's entry for w1 says 1,042: before the fix w0 ranked
    2 tokens short of w1, so cache_aware sent the request to the busy w1 and cost_aware
    called w0 a spill predicted 1,040 tokens. The tree alone picks w0 with 1,042."""
    decisions = []
    for feed in (None, feed_holding({"w0": 1042, "w1": 1042})):
        p = policy(name, feed)
        fleet = FleetView(["w0", "w1"])
        warm(p, fleet)
        fleet.loads[:] = [0, 3]
        d = p.select(request(5), fleet, 10.0)
        decisions.append((d.worker_id, d.reason, d.predicted_tokens))
    tree_alone, with_events = decisions
    assert tree_alone == ("w0", "cache_hit", 1042.0)
    assert with_events == tree_alone


@pytest.mark.parametrize("name", ["cache_aware", "cost_aware"])
def test_the_index_still_overrides_an_older_entry_it_does_not_confirm(name: str) -> None:
    """w0 evicted most of the prefix (the index holds 512 tokens of it): its older tree
    entry is not confirmed and w0 is credited what it holds, so the prefix goes to w1."""
    p = policy(name, feed_holding({"w0": 512, "w1": 1042}))
    fleet = FleetView(["w0", "w1"])
    warm(p, fleet)
    fleet.loads[:] = [0, 1]
    d = p.select(request(5), fleet, 10.0)
    assert (d.worker_id, d.predicted_tokens) == ("w1", 1042.0)


def test_the_index_counts_where_it_holds_more_than_the_trees_entry() -> None:
    """The tree's entry for w0 ends where the requests diverge (1,042 tokens); the index
    holds 71 whole blocks of the longer prompt (sent straight to w0): those count."""
    longer = (*PREFIX, *range(5000, 5100))  # 1,142 tokens: w0 holds 71 whole blocks
    feed = feed_holding({"w1": 0})
    stored = BlockStored(tuple(range(1, 72)), None, longer[: 71 * BLOCK], BLOCK)
    feed.indexes["m"].apply("w0", [stored])
    feed.streams["w0"] = StreamState("m", 1.0, status="ok")
    p = policy("cache_aware", feed)
    fleet = FleetView(["w0", "w1"], loads=[0, 9])
    assert p.select(request(1), fleet, 0.0).worker_id == "w0"  # PREFIX + a suffix, 10 s old
    d = p.select(RouteRequest("", tokens=longer, model="m"), fleet, 10.0)
    assert (d.worker_id, d.predicted_tokens) == ("w0", 71.0 * BLOCK)


def evict(feed: KvEventFeed, worker: str, at: float) -> None:
    """`worker` reports its prefix blocks removed, read by the router at `at`."""
    feed.indexes["m"].apply(worker, [BlockRemoved(tuple(range(1, 66)))], now=at)


@pytest.mark.parametrize("name", ["cache_aware", "cost_aware"])
def test_an_eviction_reported_after_the_route_outvotes_the_in_flight_entry(name: str) -> None:
    """w1 was routed the prefix 0.5 s ago (its tree entry is in the in-flight window) and
    has since reported it evicted: its blocks arrived and left, so the entry is past and
    the request goes to w0, which holds the prefix, though w0 is busier. Before the fix the
    entry outvoted the index: w1, predicted 1,042 tokens, a full miss (the replicated
    group of loadtests/results/kv_events.md)."""
    feed = feed_holding({"w0": 1042, "w1": 1042})
    p = policy(name, feed)
    fleet = FleetView(["w0", "w1"])
    warm(p, fleet)
    evict(feed, "w1", at=9.8)
    fleet.loads[:] = [3, 0]
    d = p.select(request(5), fleet, 10.0)
    assert (d.worker_id, d.predicted_tokens) == ("w0", 1042.0)


@pytest.mark.parametrize("name", ["cache_aware", "cost_aware"])
def test_an_eviction_before_the_route_leaves_the_entry_in_flight(name: str) -> None:
    """w1 lost the prefix before it was routed there again (that route prefills it anew):
    the entry is the present the index cannot show yet, and w1, idle, gets the request."""
    feed = feed_holding({"w0": 1042, "w1": 1042})
    p = policy(name, feed)
    fleet = FleetView(["w0", "w1"])
    evict(feed, "w1", at=9.2)
    warm(p, fleet)
    fleet.loads[:] = [3, 0]
    d = p.select(request(5), fleet, 10.0)
    assert (d.worker_id, d.predicted_tokens) == ("w1", 1042.0)


def test_the_index_remembers_the_latest_losses_only() -> None:
    """`lost_at` answers from at least the last `max_lost` losses, at most twice as many
    (the book turns over in two generations): bounded memory, the oldest go."""
    index = BlockIndex(BLOCK, max_lost=2)
    ids = PREFIX[: 5 * BLOCK]
    index.apply("w0", [BlockStored((1, 2, 3, 4, 5), None, ids, BLOCK)], now=0.0)
    for at, h in ((1.0, 5), (2.0, 4), (3.0, 3), (4.0, 2), (5.0, 1)):  # leaves first
        index.apply("w0", [BlockRemoved((h,))], now=at)
    assert index.lost_at("w0", ids, 0) == 5.0  # the first block
    assert index.lost_at("w0", ids, BLOCK) == 4.0
    assert index.lost_at("w0", ids, 2 * BLOCK) == 3.0  # (kept: a third, within twice 2)
    assert index.lost_at("w0", ids, 3 * BLOCK) == float("-inf")  # forgotten
    assert index.lost_at("w0", ids, 4 * BLOCK) == float("-inf")
    assert index.lost_at("w1", ids, 0) == float("-inf") and index.match(ids) == {}


def route_burst(p: Routing, fleet: FleetView) -> None:
    """Two new 1,003-token prompts go to the idle w0 at 9.5 s and 9.6 s (no match
    anywhere: the least loaded worker), on their way while the index still shows what
    w0 held before them."""
    fleet.loads[:] = [0, 5]
    for at, start in ((9.5, 20_000), (9.6, 30_000)):
        d = p.select(request(1, *range(start, start + 1000)), fleet, at)
        assert (d.worker_id, d.reason) == ("w0", "no_match")


@pytest.mark.parametrize("name", ["cache_aware", "cost_aware"])
def test_routes_that_overflow_a_small_pool_outvote_the_index(name: str) -> None:
    """w0 (a 2,000-token pool) holds the prefix, the index says so; the router has just
    sent it 2,006 new tokens, more than its pool: their prefills evict its least recently
    used blocks, the prefix first (no recent route touched it). The request goes to the
    idle w1 as no match. Before the fix the index outvoted that: w0, predicted 1,040
    tokens, a full miss (7 of 7 follow-ups on a small worker in the live capacities
    case, loadtests/results/kv_events.md)."""
    feed = feed_holding({"w0": 1042, "w1": 0})
    p = policy(name, feed)
    fleet = FleetView(["w0", "w1"], capacities=(2_000, 60_000))
    route_burst(p, fleet)
    fleet.loads[:] = [2, 0]
    d = p.select(request(5), fleet, 10.0)
    assert (d.worker_id, d.predicted_tokens) == ("w1", 0.0)


def test_a_pool_the_routes_fit_keeps_its_index_hits() -> None:
    """The same routes into a 60,000-token pool evict nothing: the index's hit stands
    (a prefix sent straight to the worker is still found there)."""
    feed = feed_holding({"w0": 1042, "w1": 0})
    p = policy("cache_aware", feed)
    fleet = FleetView(["w0", "w1"], capacities=(60_000, 60_000))
    route_burst(p, fleet)
    fleet.loads[:] = [2, 0]
    d = p.select(request(5), fleet, 10.0)
    assert (d.worker_id, d.reason, d.predicted_tokens) == ("w0", "cache_hit", 1040.0)


def test_a_route_counts_while_in_flight_then_the_index_decides() -> None:
    """`in_flight_window`: w0 was sent the prefix at 9.5 s; its blocks are not in the
    index yet (prefilling). A follow-up at 10.0 s still goes there on the tree's entry
    (events alone lost 13 points of hit rate at overload, issue 26); at 12.5 s, past
    the 2 s window of its last route (10.0 s), the index has had its say and holds nothing: no match."""
    p = policy("cache_aware", feed_holding({"w0": 0, "w1": 0}))
    fleet = FleetView(["w0", "w1"], loads=[0, 100])
    assert p.select(request(1), fleet, 9.5).worker_id == "w0"
    fleet.loads[:] = [1, 0]
    d = p.select(request(3), fleet, 10.0)
    assert (d.worker_id, d.reason, d.predicted_tokens) == ("w0", "cache_hit", 1042.0)
    assert p.select(request(5), fleet, 12.5).reason == "no_match"
