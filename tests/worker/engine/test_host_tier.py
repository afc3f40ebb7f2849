"""The host KV tier under the radix cache, driven by the real scheduler with a fake runner.

The fake runner of test_scheduler.py writes each token id into its KV slot and derives
the next token from the whole sequence read back through the slots; here it also has
a host pool and makes the step's copies (write-backs, then loads) exactly as planned.
A page that is loaded from the wrong host slot, loaded too late, written back after its
device slot was reused, or dropped from the host while still needed changes outputs,
which are compared with the reference; `check_integrity()` runs after every step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.engine.test_scheduler import VOCAB, FakeRunner, Harness, reference
from worker.engine.allocator import SlotAllocator
from worker.engine.hiradix_cache import HiRadixCache
from worker.engine.host_tier import HostTier
from worker.engine.radix_cache import RadixCache
from worker.engine.req import ReqStatus
from worker.engine.types import KVCopies


class HostFakeRunner(FakeRunner):
    def __init__(self, capacity: int, host_capacity: int) -> None:
        super().__init__(capacity)
        self.host = np.full(host_capacity, -1, dtype=np.int64)
        self.loaded = 0
        self.written = 0

    def copy_kv(self, copies: KVCopies) -> None:
        self.host[copies.write_host] = self.kv[copies.write_device]  # write-backs first
        self.kv[copies.load_device] = self.host[copies.load_host]
        self.loaded += copies.load_tokens
        self.written += copies.write_tokens


class HostHarness(Harness):
    """Harness with a host tier: the engine's step order (schedule, copies, forward)."""

    def __init__(
        self, capacity: int, host_capacity: int, write_through: bool = False, **cfg: object
    ) -> None:
        super().__init__(capacity, **cfg)
        page = self.config.page_size
        self.cache: RadixCache = (
            HiRadixCache(self.allocator, HostTier(host_capacity, write_through), page_size=page)
            if host_capacity
            else RadixCache(self.allocator, page_size=page)
        )
        self.runner = HostFakeRunner(capacity, max(host_capacity, 1))
        self.sched.cache = self.cache
        self.sched.admission.cache = self.cache
        self.sched.on_release = self.runner.release

    def step(self):  # type: ignore[override]
        batch = self.sched.schedule()
        copies = self.cache.take_copies()
        if copies is not None:
            self.runner.copy_kv(copies)
        tokens = self.runner.forward(batch.items) if batch.items else []
        self.sched.advance(batch)
        for seq, tok in zip(batch.sampled, tokens, strict=True):
            seq.append_token(tok, max_model_len=10**9)
            if seq.finish_reason is not None:
                self.sched.finish(seq)
        self.sched.check_integrity()
        self.schedules.append(batch)
        return batch


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("host", [0, 400])
def test_evicted_prefix_comes_back_from_the_host_tier(host: int) -> None:
    """A, then enough others to push A off the device, then A again: a host hit (loaded,
    not computed) with the tier; nothing without."""
    rng = random.Random(1)
    h = HostHarness(64, host, max_prefill_tokens=64, evict_batch_tokens=8)
    a = _rand(rng, 40)
    first = h.add(a, 4)
    h.run()
    for _ in range(6):
        h.add(_rand(rng, 40), 4)
        h.run()
    assert h.cache.match_prefix(a[:-1], record=False).prefix_len == 0  # off the device
    computed = h.runner.tokens_computed
    again = h.add(a, 4)
    h.run()
    assert again.output_ids == first.output_ids == reference(a, 4)
    if host:
        assert again.cached_tokens == again.host_cached_tokens == 39
        assert h.runner.tokens_computed - computed == 1 + 3  # the last prompt token, decodes
        assert h.runner.loaded == 39
    else:
        assert again.cached_tokens == 0 and h.runner.loaded == 0
        assert h.runner.tokens_computed - computed == 40 + 3


def test_write_through_copies_at_insert_and_evictions_copy_nothing() -> None:
    rng = random.Random(2)
    h = HostHarness(64, 400, write_through=True, max_prefill_tokens=64, evict_batch_tokens=8)
    a = _rand(rng, 40)
    h.add(a, 4)
    h.run()
    assert h.cache.host.written_tokens == 43  # the prompt and 3 decoded: in the tree
    assert h.allocator.available < 64  # ... while still on the device
    for _ in range(3):
        h.add(_rand(rng, 40), 4)
        h.run()
    again = h.add(a, 4)
    h.run()
    assert again.host_cached_tokens == 39 and again.output_ids == reference(a, 4)


def test_a_full_host_tier_drops_its_least_recent_pages() -> None:
    rng = random.Random(3)
    h = HostHarness(48, 80, max_prefill_tokens=64, evict_batch_tokens=4)
    prompts = [_rand(rng, 40) for _ in range(6)]
    for p in prompts:
        h.add(p, 2)
        h.run()
    assert h.cache.host.dropped_tokens > 0
    assert h.cache.host_size <= 80
    oldest = h.cache.match_prefix(prompts[0][:-1], record=False)
    assert oldest.prefix_len + oldest.host_len == 0  # dropped from both tiers
    newer = h.cache.match_prefix(prompts[-2][:-1], record=False)
    assert newer.host_len > 0


def test_flush_empties_both_tiers() -> None:
    rng = random.Random(4)
    h = HostHarness(64, 400, max_prefill_tokens=64, evict_batch_tokens=8)
    for _ in range(5):
        h.add(_rand(rng, 40), 3)
        h.run()
    assert h.cache.host_size > 0
    h.cache.reset()
    h.cache.check_integrity()
    assert h.cache.host_size == 0 and h.cache.total_size == 0
    assert h.allocator.available == h.allocator.capacity
    assert h.cache.take_copies() is None  # no write-back survives the flush


def test_in_flight_sharing_revives_host_pages_with_the_computing_request_slots() -> None:
    """A request that computes tokens the tree holds on the host only hands its device
    slots to those nodes (the same K/V), instead of freeing them."""
    rng = random.Random(5)
    h = HostHarness(64, 400, max_prefill_tokens=8, evict_batch_tokens=8)
    stem = _rand(rng, 32)
    h.add(stem + _rand(rng, 4), 2)
    h.run()
    for _ in range(4):
        h.add(_rand(rng, 40), 2)
        h.run()
    m = h.cache.match_prefix(stem, record=False)
    assert m.prefix_len == 0 and m.host_len == 32
    # Preempted and aborted paths, arrivals mid-load: outputs stay exact.
    seqs = [h.add(stem + _rand(rng, 6), 5) for _ in range(3)]
    h.run()
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 5)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(1, 24), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("flush")),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    capacity=st.integers(70, 160),
    host=st.sampled_from([0, 24, 64, 200, 600]),
    page=st.sampled_from([1, 4]),
    chunk=st.integers(8, 48),
    running=st.integers(1, 6),
    write_through=st.booleans(),
    optimistic=st.booleans(),
    script=ops,
)
def test_property_arrivals_chunks_aborts_preemptions_evictions_reloads(
    seed: int,
    capacity: int,
    host: int,
    page: int,
    chunk: int,
    running: int,
    write_through: bool,
    optimistic: bool,
    script: list[tuple],
) -> None:
    """Integrity after every step; outputs equal the reference for every request not
    aborted; at the end everything is released and a flush returns every slot."""
    rng = random.Random(seed)
    stems = [_rand(rng, rng.randrange(8, 40)) for _ in range(4)]
    h = HostHarness(
        capacity, host, write_through, page_size=page, max_prefill_tokens=chunk,
        max_running_requests=running, evict_batch_tokens=rng.randrange(1, 16),
        # Optimistic: no output reservation, so decoders run out of slots and preempt.
        init_new_token_ratio=0.0 if optimistic else 0.7,
        min_new_token_ratio=0.0 if optimistic else 0.098,
    )  # fmt: skip
    seqs, aborted = [], set()
    for op in script:
        if op[0] == "arrive":
            seqs.append(h.add(stems[op[1]] + _rand(rng, op[2]), op[3]))
        elif op[0] == "abort":
            live = [s for s in seqs if s.status is not ReqStatus.FINISHED]
            if live:
                victim = live[op[1] % len(live)]
                h.sched.abort(victim)
                aborted.add(victim.seq_id)
                h.sched.check_integrity()
        elif op[0] == "step":
            for _ in range(op[1]):
                if h.sched.has_work:
                    h.step()
        else:
            h.cache.reset()
            h.sched.check_integrity()
    h.run()
    for s in seqs:
        if s.seq_id not in aborted:
            assert s.output_ids == reference(s.prompt_ids, s.params.max_tokens)
    h.cache.reset()
    h.cache.check_integrity()
    assert h.allocator.available == capacity
    assert not isinstance(h.cache, HiRadixCache) or h.cache.host_size == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_load_with_a_small_host_tier_reloads_and_stays_exact(seed: int) -> None:
    """Long random runs (preemptions and host drops happen): reloads must occur."""
    rng = random.Random(seed)
    stems = [_rand(rng, rng.randrange(10, 40)) for _ in range(4)]
    h = HostHarness(
        rng.randrange(90, 140), rng.choice([60, 150, 400]), rng.random() < 0.5,
        page_size=rng.choice([1, 4]), max_prefill_tokens=rng.randrange(8, 48),
        max_running_requests=rng.randrange(2, 6), evict_batch_tokens=rng.randrange(1, 16),
        init_new_token_ratio=0.0, min_new_token_ratio=0.0,  # preemptions happen
    )  # fmt: skip
    h.drive_random(
        rng, stems, steps=400, arrive_until=200, p_arrive=0.3, p_abort=0.05, max_suffix=20,
        max_tokens=20,
    )  # fmt: skip
    assert h.runner.loaded > 0 and h.sched.num_preemptions > 0
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity and h.cache.host_size == 0


def test_cache_units_split_lock_and_host_only_nodes() -> None:
    a = SlotAllocator(16)
    c = HiRadixCache(a, HostTier(32))
    slots = a.alloc(8)
    c.insert(list(range(1, 9)), slots)
    assert c.evict(8) == 8 and a.available == 16
    copies = c.take_copies()
    assert copies is not None and sorted(copies.write_device.tolist()) == sorted(slots.tolist())
    m = c.match_prefix([1, 2, 3, 4, 99])  # splits a host-only node
    assert (m.prefix_len, m.host_len) == (0, 4) and c.host_hit_tokens == 4
    c.check_integrity()
    c.lock(m.last_node)
    assert c._evict_host(32) == 4  # the unlocked host-only lower half goes; the locked stays
    dev = c.load(m.last_node)
    assert len(dev) == 4 and c.protected_size == 4
    c.check_integrity()
    c.unlock(m.last_node)
    assert c.evictable_size == 4
    a.check_integrity(owned=c.cached_slots())
    c.check_integrity()


def test_an_exact_fit_drops_one_host_leaf_and_no_more() -> None:
    """The host LRU, asked for exactly one host-only leaf's slots, drops that leaf only."""
    a = SlotAllocator(16)
    c = HiRadixCache(a, HostTier(8))
    for first in (1, 2):  # two 4-token prompts, demoted to the host: it is full
        c.insert([first] * 4, a.alloc(4))
        assert c.evict(4) == 4
    c.take_copies()
    assert c.host_size == 8 and c.evictable_size == 0
    assert c._evict_host(4) == 4  # the older one, [1 1 1 1]
    assert [c.match_prefix([f] * 4, record=False).host_len for f in (1, 2)] == [0, 4]
    c.check_integrity()


def test_kv_events_follow_each_tier_with_its_medium() -> None:
    """A demotion stores the blocks on the host ("CPU") and then removes them from the
    device ("GPU"); a load back stores them on the device and the host copy stays; the
    host LRU dropping a host-only node removes it from the host; a republish walks
    both tiers."""
    from shared.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from worker.engine.kv_blocks import BlockEvents

    def moves(events: BlockEvents) -> list[tuple[str, str | None]]:
        return [(type(e).__name__, getattr(e, "medium", None)) for e in events.drain(100)]

    a = SlotAllocator(16)
    c = HiRadixCache(a, HostTier(8))
    events = BlockEvents(block_size=4)
    c.publish_events(events)
    events.drain(100)  # the epoch's AllBlocksCleared
    c.insert(list(range(1, 9)), a.alloc(8))
    assert moves(events) == [("BlockStored", "GPU")]
    assert c.evict(8) == 8 and c.take_copies() is not None  # written back, still cached
    assert moves(events) == [("BlockStored", "CPU"), ("BlockRemoved", "GPU")]
    m = c.match_prefix(list(range(1, 9)), record=False)
    c.lock(m.last_node)
    assert len(c.load(m.last_node)) == 8 and c.take_copies() is not None
    c.unlock(m.last_node)
    stored = events.drain(100)
    assert [(type(e), e.medium) for e in stored] == [(BlockStored, "GPU")]  # the copy stays
    assert stored[0].token_ids.tolist() == list(range(1, 9)) and stored[0].parent_block_hash is None
    assert c.evict(8) == 8  # has its host copy already: nothing written, only the move
    assert moves(events) == [("BlockRemoved", "GPU")]
    events.request_republish()
    c.insert(list(range(20, 24)), a.alloc(4))  # the republish walks the host-only node
    kinds = [(type(e), getattr(e, "medium", None)) for e in events.drain(100)]
    assert kinds[0][0] is AllBlocksCleared
    assert sorted(kinds[1:]) == sorted([(BlockStored, "CPU"), (BlockStored, "GPU")])
    c.insert(list(range(30, 38)), a.alloc(8))
    assert c.evict(16) >= 8  # the host tier (8 slots) must drop the first prompt for room
    removed = [e for e in events.drain(100) if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed and c.match_prefix(list(range(1, 9)), record=False).host_len == 0
    c.check_integrity()
