"""KV events per tier: replayed into an empty router index, they reproduce which blocks the
engine holds on its device ("GPU") and which on its host tier ("CPU"), exactly.

Driven by the real scheduler over a radix cache with a host tier (test_host_tier's
harness: arrivals, chunked prefills, preemptions, aborts, device evictions written back
to the host, loads back, host LRU drops), plus flushes and restarts. After every
operation the published events go through the wire form into a `BlockIndex`, and its
media bits per block must equal the tree's: a block is held in a tier when the node
holding its last token is (kv_blocks.py).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.holdings.kv_index import BlockIndex
from shared.wire.kv_events import BlockStored, decode_batch, encode_batch
from tests.worker.engine.test_host_tier import HostHarness, _rand
from worker.engine.kv_blocks import BlockEvents
from worker.engine.radix_cache import RadixCache
from worker.engine.req import ReqStatus

GPU, CPU = 1, 2


def tree_tiers(cache: RadixCache, index: BlockIndex) -> dict[int, int]:
    """Block key -> media bits, from the tree: each block is in its end node's tiers."""
    bs = index.block_size
    out: dict[int, int] = {}
    stack = [(c, []) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key.tolist()
        bits = (GPU if node.value is not None else 0) | (CPU if node.host_value is not None else 0)
        keys = index.keys(path)
        for j in range(len(above) // bs, len(path) // bs):  # blocks ending in this node
            out[keys[j]] = out.get(keys[j], 0) | bits
        stack.extend((c, path) for c in node.children.values())
    return out


def index_tiers(index: BlockIndex, worker: str = "w") -> dict[int, int]:
    return {k: holders[worker][0] for k, holders in index._blocks.items() if worker in holders}


def replay(events: BlockEvents, index: BlockIndex, worker: str = "w") -> None:
    while batch := events.drain(5):  # small batches, through the wire form
        index.apply(worker, decode_batch(encode_batch(batch)).events)


def with_events(h: HostHarness, block: int, max_pending: int = 200_000) -> BlockEvents:
    events = BlockEvents(block, max_pending=max_pending)
    h.cache.publish_events(events)
    return events


ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(1, 24), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("restart")),
    ),
    min_size=10,
    max_size=60,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    capacity=st.integers(70, 160),
    host=st.sampled_from([0, 24, 64, 200]),
    page=st.sampled_from([1, 4]),
    block=st.sampled_from([1, 3, 4, 6]),
    chunk=st.integers(8, 48),
    write_through=st.booleans(),
    max_pending=st.sampled_from([200_000, 200_000, 12]),
    script=ops,
)
def test_property_events_per_tier_reproduce_the_tree(
    seed: int,
    capacity: int,
    host: int,
    page: int,
    block: int,
    chunk: int,
    write_through: bool,
    max_pending: int,
    script: list[tuple],
) -> None:
    """A small backlog (`max_pending` 12) overflows within an operation: the events are
    dropped and the next change republishes the tree, both tiers (checked once it has)."""
    rng = random.Random(seed)
    stems = [_rand(rng, rng.randrange(8, 40)) for _ in range(4)]

    def harness() -> HostHarness:
        return HostHarness(
            capacity, host, write_through, page_size=page, max_prefill_tokens=chunk,
            max_running_requests=4, evict_batch_tokens=rng.randrange(1, 16),
            init_new_token_ratio=0.0, min_new_token_ratio=0.0,  # preemptions happen
        )  # fmt: skip

    h = harness()
    events = with_events(h, block, max_pending)
    index = BlockIndex(block)
    seqs = []
    for op in script:
        if op[0] == "arrive":
            seqs.append(h.add(stems[op[1]] + _rand(rng, op[2]), op[3]))
        elif op[0] == "abort":
            live = [s for s in seqs if s.status is not ReqStatus.FINISHED]
            if live:
                h.sched.abort(live[op[1] % len(live)])
        elif op[0] == "step":
            for _ in range(op[1]):
                if h.sched.has_work:
                    h.step()
        elif op[0] == "flush":
            h.cache.reset()
        else:  # a new process: empty caches; its first event clears the old epoch
            h, seqs = harness(), []
            events = with_events(h, block, max_pending)
        replay(events, index)
        if not events._lost:  # lost: the reader is told at the next change, not before
            assert index_tiers(index) == tree_tiers(h.cache, index)
    h.run()
    replay(events, index)
    if not events._lost:
        assert index_tiers(index) == tree_tiers(h.cache, index)


class CheckedHarness(HostHarness):
    """After every engine step (and a flush every `flush_every` steps): the published
    events, replayed, reproduce both tiers of the tree."""

    def __init__(
        self, *args: object, block: int, max_pending: int, flush_every: int, **cfg: object
    ):
        super().__init__(*args, **cfg)  # type: ignore[arg-type]
        self.events = with_events(self, block, max_pending)
        self.index = BlockIndex(block)
        self.flush_every, self.steps, self.checked = flush_every, 0, 0

    def step(self):  # type: ignore[no-untyped-def]
        batch = super().step()
        self.steps += 1
        if self.steps % self.flush_every == 0:
            self.cache.reset()
        replay(self.events, self.index)
        if not self.events._lost:
            assert index_tiers(self.index) == tree_tiers(self.cache, self.index), self.steps
            self.checked += 1
        return batch


@pytest.mark.parametrize("seed", range(4))
def test_long_random_runs_demote_reload_drop_and_the_index_follows(seed: int) -> None:
    """Long random runs where loads back, host drops and preemptions do happen (asserted),
    the index checked after every step; odd seeds with a 4-event backlog that overflows
    (the next change republishes both tiers after an AllBlocksCleared)."""
    rng = random.Random(seed)
    stems = [_rand(rng, rng.randrange(10, 40)) for _ in range(4)]
    h = CheckedHarness(
        rng.randrange(90, 140), rng.choice([60, 150]), rng.random() < 0.5,
        block=rng.choice([1, 3, 4, 8]), max_pending=(200_000, 4)[seed % 2], flush_every=150,
        page_size=rng.choice([1, 4]), max_prefill_tokens=rng.randrange(8, 48),
        max_running_requests=rng.randrange(2, 6), evict_batch_tokens=rng.randrange(1, 16),
        init_new_token_ratio=0.0, min_new_token_ratio=0.0,
    )  # fmt: skip
    h.drive_random(
        rng, stems, steps=400, arrive_until=300, p_arrive=0.3, p_abort=0.05, max_suffix=20,
        max_tokens=20,
    )  # fmt: skip
    assert h.runner.loaded > 0 and h.cache.host.dropped_tokens > 0
    assert h.checked > 100 and (h.events.dropped > 0) == (seed % 2 == 1)  # republished


def test_demotion_load_back_and_host_drop_as_the_router_sees_them() -> None:
    """One prompt through its life as `match_tiers` reports it: on the device, demoted
    (its tail on the host only), loaded back (on the device again, the host copy kept),
    pushed out of both tiers (gone)."""
    rng = random.Random(7)
    h = HostHarness(64, 96, max_prefill_tokens=64, evict_batch_tokens=8)
    events = with_events(h, 4)
    index = BlockIndex(4)
    a = _rand(rng, 40)
    h.add(a, 2)
    h.run()
    replay(events, index)
    first = index.match_tiers(a)["w"]
    assert first == (40, 40)  # 40 of the 41 tokens in the tree: 10 whole blocks on the device
    for _ in range(2):  # others push a off the device, to the host
        h.add(_rand(rng, 40), 2)
        h.run()
    replay(events, index)
    assert index.match_tiers(a)["w"][0] < 40 and index.match_tiers(a)["w"][1] == 40
    h.add(a, 2)  # a hit: loaded back
    h.run()
    replay(events, index)
    assert index.match_tiers(a)["w"] == (40, 40)
    assert index_tiers(index) == tree_tiers(h.cache, index)
    for _ in range(6):  # enough others to push a out of both tiers
        h.add(_rand(rng, 40), 2)
        h.run()
    replay(events, index)
    assert "w" not in index.match_tiers(a)
    assert index_tiers(index) == tree_tiers(h.cache, index)


def test_a_host_only_node_stores_its_blocks_with_their_tokens_and_parent() -> None:
    """What a host-tier store carries (the router keys blocks by content and parent): the
    same block hashes, token ids and parent as the device store of the same node."""
    h = HostHarness(32, 64, max_prefill_tokens=64, evict_batch_tokens=8)
    events = with_events(h, 4)
    h.add(list(range(1, 22)), 1)
    h.run()
    on_device = [e for e in events.drain(100) if isinstance(e, BlockStored)]
    h.cache.evict(32)
    on_host = [e for e in events.drain(100) if isinstance(e, BlockStored)]
    assert {e.medium for e in on_device} == {"GPU"} and {e.medium for e in on_host} == {"CPU"}

    def blocks(stored: list[BlockStored]) -> dict[int, tuple[object, list[int]]]:
        out = {}
        for e in stored:
            parent = e.parent_block_hash
            for i, bh in enumerate(e.block_hashes):
                out[bh] = (parent, list(e.token_ids[i * 4 : (i + 1) * 4]))
                parent = bh
        return out

    assert blocks(on_host) == blocks(on_device)
