"""`python -m loadtests kv-feed`'s stream: split into events of at most `--event-blocks`
blocks, it stores and removes the same blocks, and a feed applying it answers as one
applying the unsplit stream (the bench's two shapes measure the same index work)."""

from __future__ import annotations

import argparse

from loadtests.router.bench_kv_feed import add_arguments, record
from router.holdings.kv_feed import FeedMember, KvEventFeed
from shared.wire.kv_events import BlockRemoved, BlockStored, decode_batch


def stream(event_blocks: int) -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--requests", "60", "--sessions", "4", "--prompt-tokens", "200",
                         "--pool-blocks", "40", "--event-blocks", str(event_blocks)])  # fmt: skip
    return record(args)


def answers(d: dict) -> list:
    feed = KvEventFeed(None, route_clock=lambda: 1.0)  # type: ignore[arg-type]  # by hand
    feed.follow([FeedMember("w0", "m", 1.0, 0, block_size=d["block_size"])])
    for fields in d["entries"]:
        feed.apply_entry("w0", fields)
    assert not feed.dropped
    return [sorted(feed.indexes["m"].match_tiers(p).items()) for p in d["probes"]]


def test_events_of_at_most_n_blocks_store_and_remove_the_same_blocks() -> None:
    whole, split = stream(0), stream(6)
    assert (whole["stored"], whole["removed"]) == (split["stored"], split["removed"])
    assert whole["removed"] > 0  # the pool evicts: both kinds are split
    events = [e for f in split["entries"] for e in decode_batch(f[b"batch"]).events]
    sizes = [len(e.block_hashes) for e in events if isinstance(e, BlockStored | BlockRemoved)]
    assert max(sizes) <= 6
    assert len(events) > sum(len(decode_batch(f[b"batch"]).events) for f in whole["entries"])
    assert answers(whole) == answers(split)
