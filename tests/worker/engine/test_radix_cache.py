"""RadixCache: exact unit cases, then a stateful property test against a reference model.

The reference knows, for every slot ever allocated, which prefix (tuple of tokens up
to and including that token) its KV was computed for. So whatever the tree does
inside, a matched slot must carry exactly the prompt's prefix, and the set of cached
page-aligned prefixes is known exactly: inserts add theirs, evictions may only remove
unlocked ones. (Token-level prefixes may repeat: two pages that differ only in their
second half both hold the KV of the shared first half.)
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worker.engine.allocator import SlotAllocator
from worker.engine.prefix_cache import NoCache
from worker.engine.radix_cache import RadixCache


def make(capacity: int = 100, page_size: int = 1) -> tuple[SlotAllocator, RadixCache]:
    a = SlotAllocator(capacity)
    return a, RadixCache(a, page_size=page_size)


def put(cache: RadixCache, tokens: list[int]) -> np.ndarray:
    """Run one request the scheduler's way (match, lock, alloc, insert, unlock); its slots."""
    m = cache.match_prefix(tokens)
    cache.lock(m.last_node)
    new = cache.allocator.alloc(len(tokens) - m.prefix_len)
    assert new is not None
    value = np.concatenate((m.slots, new))
    cache.insert(tokens, value, cached_len=m.prefix_len)
    cache.unlock(m.last_node)
    return value


def tree(node) -> dict:
    return {tuple(c.key.tolist()): tree(c) for c in node.children.values()}


def held(cache: RadixCache, tokens: list[int]) -> int:
    """Cached prefix length without touching LRU times (compare with a fresh walk)."""
    node, n = cache.root, 0
    while True:
        nxt = [c for c in node.children.values() if tokens[n : n + len(c)] == c.key.tolist()]
        if not nxt:
            return n
        node, n = nxt[0], n + len(nxt[0])


def test_worked_example_tree_from_the_docstring() -> None:
    a, c = make()
    put(c, [1, 2, 3, 4])
    assert c.insert([1, 2, 5], a.alloc(3), cached_len=0) == 2  # type: ignore[arg-type]
    assert tree(c.root) == {(1, 2): {(3, 4): {}, (5,): {}}}
    c.check_integrity()
    a.check_integrity(owned=c.cached_slots())


def test_match_splits_where_the_match_ends() -> None:
    _, c = make()
    slots = put(c, [1, 2, 3, 4])
    m = c.match_prefix([1, 2, 9])
    assert m.prefix_len == 2 and m.slots.tolist() == slots[:2].tolist()
    assert m.last_node.key.tolist() == [1, 2]
    assert tree(c.root) == {(1, 2): {(3, 4): {}}}
    assert c.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    c.check_integrity()


def test_insert_frees_slots_of_tokens_cached_meanwhile() -> None:
    a, c = make(capacity=10)
    first = put(c, [1, 2, 3])
    second = a.alloc(4)  # a concurrent request that matched nothing
    assert second is not None
    assert c.insert([1, 2, 3, 4], second, cached_len=0) == 3
    assert a.available == 10 - 4  # the 3 duplicates came back
    assert c.match_prefix([1, 2, 3, 4]).slots.tolist() == [*first.tolist(), int(second[3])]
    a.check_integrity(owned=c.cached_slots())


def test_locked_path_is_never_evicted_and_reset_keeps_it() -> None:
    a, c = make()
    put(c, [1, 1, 1])
    put(c, [2, 2])
    put(c, [1, 1, 3])
    m = c.match_prefix([1, 1, 1])
    c.lock(m.last_node)
    assert c.protected_size == 3 and c.evictable_size == 3
    assert c.evict(100) == 3  # [2 2] and [3]; [1 1] and [1] are locked
    assert held(c, [1, 1, 1]) == 3 and held(c, [2, 2]) == 0
    put(c, [5, 5])
    c.reset()
    assert c.total_size == 3 and held(c, [1, 1, 1]) == 3
    c.unlock(m.last_node)
    c.reset()
    assert c.total_size == 0 and a.available == a.capacity
    c.check_integrity()


def test_evicts_least_recently_used_leaf_first() -> None:
    _, c = make()
    for t in ([1, 1], [2, 2], [3, 3]):
        put(c, t)
    c.match_prefix([1, 1])  # [1 1] is now the most recent
    assert c.evict(1) == 2  # a whole leaf goes, never part of one
    assert [held(c, t) for t in ([1, 1], [2, 2], [3, 3])] == [2, 0, 2]
    c.evict(1)
    assert [held(c, t) for t in ([1, 1], [2, 2], [3, 3])] == [2, 0, 0]


def test_an_exact_fit_evicts_one_leaf_and_no_more() -> None:
    """Asked for exactly one leaf's tokens, evict stops there: the next leaf stays."""
    a, c = make()
    for t in ([1, 1], [2, 2], [3, 3]):
        put(c, t)
    assert c.evict(2) == 2 and a.available == 100 - 4
    assert [held(c, t) for t in ([1, 1], [2, 2], [3, 3])] == [0, 2, 2]


def test_a_parent_left_childless_joins_the_eviction() -> None:
    _, c = make()
    put(c, [1, 2, 3])
    put(c, [1, 2, 4])
    put(c, [9])
    c.match_prefix([9])
    assert c.evict(3) == 4  # [3], [4], then their parent [1 2]; [9] is newer
    assert tree(c.root) == {(9,): {}}


def test_evict_counts_and_limits() -> None:
    a, c = make()
    assert c.evict(5) == 0
    put(c, [1, 2, 3, 4, 5])
    assert c.evict(0) == 0 and c.evict(-3) == 0
    assert c.evict(1) == 5 and a.available == 100


def test_eviction_pops_only_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The structure: heapify the leaves, pop one per evicted node (no full sort)."""
    _, c = make(capacity=200)
    for i in range(50):
        put(c, [i, i])
    pops = []
    real_pop = heapq.heappop

    def counting_pop(heap: list) -> object:
        pops.append(1)
        return real_pop(heap)

    monkeypatch.setattr(heapq, "heappop", counting_pop)
    assert c.evict(3) == 4
    assert len(pops) == 2


def test_page_size_aligns_matches_and_frees_the_tail() -> None:
    a, c = make(capacity=40, page_size=4)
    t = list(range(10))
    slots = a.alloc(10)
    assert slots is not None
    assert c.insert(t, slots) == 0
    assert c.total_size == 8 and a.available == 40 - 8  # the 2-token tail went back
    assert c.match_prefix(t[:7]).prefix_len == 4
    m = c.match_prefix([0, 1, 2, 3, 4, 5, 99, 99, 99])
    assert m.prefix_len == 4 and m.slots.tolist() == slots[:4].tolist()
    assert c.match_prefix([0, 1, 2]).prefix_len == 0
    assert tree(c.root) == {(0, 1, 2, 3): {(4, 5, 6, 7): {}}}
    c.check_integrity()


def test_hit_and_miss_counters() -> None:
    _, c = make()
    put(c, [1, 2, 3])  # match of 3 misses
    c.match_prefix([1, 2, 7, 7])
    assert (c.hit_tokens, c.miss_tokens) == (2, 3 + 2)


def test_returned_slots_cannot_corrupt_the_tree() -> None:
    _, c = make()
    slots = put(c, [4, 4, 4])
    m = c.match_prefix([4, 4, 4])
    m.slots[:] = -1
    assert c.match_prefix([4, 4, 4]).slots.tolist() == slots.tolist()


def test_misuse_is_refused() -> None:
    a, c = make()
    with pytest.raises(ValueError, match="slots for"):
        c.insert([1, 2], np.array([0]))
    with pytest.raises(ValueError, match="exceeds the cached prefix"):
        c.insert([1, 2], a.alloc(2), cached_len=2)  # type: ignore[arg-type]
    put(c, [1, 2])
    with pytest.raises(RuntimeError, match="unlock"):
        c.unlock(c.match_prefix([1, 2]).last_node)
    with pytest.raises(ValueError):
        RadixCache(a, page_size=0)


def test_nocache_caches_nothing_and_frees_everything() -> None:
    a = SlotAllocator(8)
    c = NoCache(a)
    m = c.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and len(m.slots) == 0
    c.lock(m.last_node)
    slots = a.alloc(3)
    assert c.insert([1, 2, 3], slots) == 0  # type: ignore[arg-type]
    c.unlock(m.last_node)
    assert a.available == 8 and c.total_size == 0 and c.evict(10) == 0
    assert (c.hit_tokens, c.miss_tokens) == (0, 3)
    c.check_integrity()


# ---- stateful property test ------------------------------------------------------
PAGES = ([0] * 16, [1] * 16, [0] * 8 + [1] * 8, [0, 1] * 8)  # C shares half a page with A


class CacheModel(RuleBasedStateMachine):
    """Random match / start (match+lock+alloc) / finish (insert+unlock) / abort / evict / reset."""

    page = 1
    capacity = 24
    second_chance = 0  # the cap, tokens (worker/engine/radix_cache.py)

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(self.capacity)
        self.cache = RadixCache(self.alloc, self.page, self.second_chance)
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # slot -> prefix its KV was made for
        self.cached: set[tuple[int, ...]] = set()  # page-aligned prefixes the tree must hold
        self.running: list[tuple[list[int], object, np.ndarray]] = []  # tokens, match, own slots

    def longest(self, toks: list[int]) -> int:
        n = len(toks) - len(toks) % self.page
        while n and tuple(toks[:n]) not in self.cached:
            n -= self.page
        return n

    def pages(self, toks: list[int], n: int) -> set[tuple[int, ...]]:
        return {tuple(toks[:k]) for k in range(self.page, n + 1, self.page)}

    def locked(self) -> set[tuple[int, ...]]:
        return set().union(*(self.pages(t, m.prefix_len) for t, m, _ in self.running))

    def tree_prefixes(self) -> set[tuple[int, ...]]:
        slots = self.cache.cached_slots()
        found = {p for s in slots.tolist() if len(p := self.prefix_of[s]) % self.page == 0}
        assert len(found) * self.page == len(slots), "one page-aligned prefix cached twice"
        return found

    def do_match(self, toks: list[int]):
        expected = self.longest(toks)
        hits, misses = self.cache.hit_tokens, self.cache.miss_tokens
        m = self.cache.match_prefix(toks)
        assert m.prefix_len == expected == len(m.slots)
        assert [self.prefix_of[int(s)] for s in m.slots] == [
            tuple(toks[: i + 1]) for i in range(expected)
        ]
        assert self.cache.hit_tokens - hits == expected
        assert self.cache.miss_tokens - misses == len(toks) - expected
        return m

    def do_evict(self, n: int) -> None:
        before, evictable, locked = set(self.cached), self.cache.evictable_size, self.locked()
        freed = self.cache.evict(n)
        self.cached = self.tree_prefixes()
        removed = before - self.cached
        assert self.cached <= before and freed == len(removed) * self.page
        assert not removed & locked, "evicted a locked prefix"
        assert freed >= min(max(n, 0), evictable) and (freed == 0 or n > 0)
        closed = all(p[: -self.page] in self.cached for p in self.cached if len(p) > self.page)
        assert closed, "cached prefixes are not prefix-closed"

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        self.do_match(data.draw(self.tokens()))

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        toks = data.draw(self.tokens())
        m = self.do_match(toks)
        self.cache.lock(m.last_node)
        need = len(toks) - m.prefix_len
        if self.alloc.available < need:
            self.do_evict(need - self.alloc.available)
        new = self.alloc.alloc(need)
        if new is None:
            self.cache.unlock(m.last_node)
            return
        for i, s in enumerate(new.tolist()):
            self.prefix_of[s] = tuple(toks[: m.prefix_len + i + 1])
        self.running.append((toks, m, new))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        toks, m, new = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        expected = self.longest(toks)
        assert (
            self.cache.insert(toks, np.concatenate((m.slots, new)), cached_len=m.prefix_len)
            == expected
        )
        self.cache.unlock(m.last_node)
        limit = len(toks) - len(toks) % self.page
        self.cached |= self.pages(toks, limit)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        _, m, new = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.alloc.free(new)
        self.cache.unlock(m.last_node)

    @rule(n=st.integers(-1, 40))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.cached = self.tree_prefixes()
        assert self.cached == self.locked()

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        own = [new for _, _, new in self.running]
        self.alloc.check_integrity(owned=np.concatenate([self.cache.cached_slots(), *own]))
        assert self.tree_prefixes() == self.cached
        assert self.cache.protected_size == len(self.locked()) * self.page
        assert self.cache.total_size == len(self.cached) * self.page

    def tokens(self) -> st.SearchStrategy[list[int]]:
        return st.lists(st.integers(0, 2), max_size=10)


class PagedCacheModel(CacheModel):
    page = 16
    capacity = 160

    def tokens(self) -> st.SearchStrategy[list[int]]:
        pages = st.lists(st.sampled_from(PAGES), max_size=4)
        tail = st.tuples(st.sampled_from(PAGES), st.integers(0, 15)).map(lambda pt: pt[0][: pt[1]])
        return st.tuples(pages, tail).map(lambda pt: [t for p in pt[0] for t in p] + pt[1])


class SecondChanceCacheModel(CacheModel):
    """The same rules with the capped second chance on: no prefix the model needs is
    lost, and check_integrity holds the granted count to the cap."""

    second_chance = 6


_settings = settings(max_examples=200, stateful_step_count=30, derandomize=True, deadline=None)
TestCacheModel = CacheModel.TestCase
TestCacheModel.settings = _settings
TestPagedCacheModel = PagedCacheModel.TestCase
TestPagedCacheModel.settings = _settings
TestSecondChanceCacheModel = SecondChanceCacheModel.TestCase
TestSecondChanceCacheModel.settings = _settings
