"""The radix cache's KV events, replayed into an empty router index, reproduce its tree.

The expected blocks come from the tree itself (every whole block along every path); the
actual ones from the router's `BlockIndex` fed only the published events, through the
wire encoding. The state machines of test_radix_cache drive arrivals, evictions,
flushes; a `restart` rule swaps in a new cache (a new epoch starts with AllBlocksCleared).
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis.stateful import invariant, rule

from router.holdings.kv_index import BlockIndex
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from tests.worker.engine.test_radix_cache import CacheModel, PagedCacheModel, make, put
from worker.engine.allocator import SlotAllocator
from worker.engine.kv_blocks import BlockEvents
from worker.engine.radix_cache import RadixCache


def expected_keys(cache: RadixCache, index: BlockIndex) -> set[int]:
    """Keys of every whole block the tree holds (a block is held with its last token)."""
    out: set[int] = set()
    stack = [(c, []) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key.tolist()
        out.update(index.keys(path))
        stack.extend((c, path) for c in node.children.values())
    return out


def held_keys(index: BlockIndex, worker: str) -> set[int]:
    return {k for k, holders in index._blocks.items() if worker in holders}


def replay(events: BlockEvents, index: BlockIndex, worker: str = "w") -> None:
    while batch := events.drain(7):  # small batches, through the wire form
        index.apply(worker, decode_batch(encode_batch(batch)).events)


class EventsModel(CacheModel):
    block = 3

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(self.block)
        self._events_on()

    def _events_on(self) -> None:
        self.events = BlockEvents(self.block)
        self.cache.publish_events(self.events)

    @rule()
    def restart(self) -> None:
        """A new process: empty cache, new events (the old epoch's backlog is lost)."""
        self.alloc = SlotAllocator(self.capacity)
        self.cache = RadixCache(self.alloc, page_size=self.page)
        self.prefix_of.clear()
        self.cached = set()
        self.running = []
        self._events_on()

    @invariant()
    def index_matches_tree(self) -> None:
        replay(self.events, self.index)
        assert held_keys(self.index, "w") == expected_keys(self.cache, self.index)
        assert self.index.blocks_of("w") == len(held_keys(self.index, "w"))


class PagedEventsModel(EventsModel, PagedCacheModel):
    block = 8  # smaller than a page: blocks end inside nodes


class PagedBigBlocksModel(EventsModel, PagedCacheModel):
    block = 24  # a page and a half: blocks straddle node boundaries


TestEvents = EventsModel.TestCase
TestEvents.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedEvents = PagedEventsModel.TestCase
TestPagedEvents.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPagedBigBlocks = PagedBigBlocksModel.TestCase
TestPagedBigBlocks.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_worked_example_from_the_module_doc() -> None:
    _a, c = make(capacity=200)
    events = BlockEvents(16)
    c.publish_events(events)
    put(c, list(range(50)))
    stored = [e for e in events.drain(100) if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3]  # 48 of 50 tokens: 3 whole blocks
    assert stored[0].token_ids.tolist() == list(range(48)) and stored[0].parent_block_hash is None
    put(c, [*range(20), 99])  # splits at 20: the blocks stay, the new leaf holds none
    assert events.drain(100) == []
    c.evict(200)
    removed = events.drain(100)  # leaves go first: [20:50] (blocks 2, 3), then [0:20] (1)
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored[0].block_hashes)


def test_a_full_backlog_republishes_the_tree_after_a_clear() -> None:
    _a, c = make(capacity=400)
    events = BlockEvents(4, max_pending=3)
    c.publish_events(events)
    index = BlockIndex(4)
    for i in range(3):  # more events than the backlog holds, nobody draining
        put(c, [i, *range(10, 30)])
    assert events.dropped == 3 and not events.pending
    put(c, [7, 7, 7, 7, 7])  # the next change republishes
    batch = events.drain(1000)
    assert isinstance(batch[0], AllBlocksCleared)
    index.apply("w", batch)
    assert held_keys(index, "w") == expected_keys(c, index)


def test_events_must_start_with_the_tree() -> None:
    _a, c = make()
    put(c, [1, 2, 3])
    try:
        c.publish_events(BlockEvents(2))
    except RuntimeError:
        return
    raise AssertionError("a late start must be refused")


def test_match_follows_the_longest_run_per_worker() -> None:
    index = BlockIndex(2)
    toks = list(range(8))
    for worker, n in (("a", 8), ("b", 4)):
        _a, c = make()
        events = BlockEvents(2)
        c.publish_events(events)
        put(c, toks[:n])
        index.apply(worker, events.drain(100))
    assert index.match(np.array([*toks, 9])) == {"a": 8, "b": 4}
    assert index.match([5, 5]) == {}


def test_a_split_on_a_block_boundary_keeps_the_block_above() -> None:
    _a, c = make(capacity=100)
    events = BlockEvents(3)
    c.publish_events(events)
    index = BlockIndex(3)
    put(c, [0, 1, 2, 3, 4, 5])
    put(c, [0, 1, 2, 9])  # splits at 3, where a block ends: that block stays above
    c.evict(3)  # the older lower half [3 4 5] goes, and only the block ending at 6
    replay(events, index)
    assert held_keys(index, "w") == expected_keys(c, index) == set(index.keys([0, 1, 2]))


def test_blocks_of_zeros_at_different_depths_have_different_keys() -> None:
    index = BlockIndex(4)
    keys = index.keys([0] * 12)
    assert len(set(keys)) == 3 and 0 not in keys  # 0 is the root's parent key


def test_a_block_held_twice_below_page_granularity_stays_until_both_go() -> None:
    _a, c = make(capacity=160, page_size=16)
    events = BlockEvents(8)
    c.publish_events(events)
    index = BlockIndex(8)
    put(c, [0] * 16)
    put(c, [0] * 8 + [1] * 8)  # another page: the first 8 tokens are cached a second time
    c.evict(1)  # the older leaf goes; the second copy of the [0]*8 block stays
    replay(events, index)
    assert held_keys(index, "w") == expected_keys(c, index) == set(index.keys([0] * 8 + [1] * 8))


def test_events_of_large_blocks_stay_within_what_readers_decode() -> None:
    """Readers refuse an event of more than MAX_EVENT_TOKENS token ids (one event is one
    decode step on a router's event loop: shared/wire/kv_events.py). At 4,096-token
    blocks, 1,024 blocks an event would be 4M ids: the cache publishes fewer blocks per
    event, and every event it publishes, in its stores and its republish, decodes."""
    from shared.wire.kv_events import MAX_EVENT_TOKENS

    bs, blocks = 4096, 160  # 655,360 tokens: more than two events' worth
    _a, c = make(capacity=bs * blocks + 8)
    events = BlockEvents(bs, max_pending=1)  # the store overflows it: a republish follows
    c.publish_events(events)
    tokens = [i % 30_000 for i in range(bs * blocks)]
    put(c, tokens)
    index = BlockIndex(bs)
    put(c, [1, 2, 3])  # the next change republishes the whole tree
    published = events.drain(10_000)
    assert isinstance(published[0], AllBlocksCleared)
    stored = [e for e in published if isinstance(e, BlockStored)]
    assert len(stored) >= 3 and all(len(e.token_ids) <= MAX_EVENT_TOKENS for e in stored)
    for e in published:  # each through the wire form, one event a batch
        index.apply("w", decode_batch(encode_batch([e])).events)
    assert held_keys(index, "w") == expected_keys(c, index)
    fresh = BlockEvents(bs)  # and as stored live, without a republish
    _b, d = make(capacity=bs * blocks + 8)
    d.publish_events(fresh)
    put(d, tokens)
    live = [e for e in fresh.drain(10_000) if isinstance(e, BlockStored)]
    assert len(live) >= 3 and all(len(e.token_ids) <= MAX_EVENT_TOKENS for e in live)
    assert all(decode_batch(encode_batch([e])).events for e in live)
