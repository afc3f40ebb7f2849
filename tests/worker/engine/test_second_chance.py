"""The radix cache's capped, aged second chance (worker/engine/second_chance.py): a prefix
an admission came back for is requeued once when it reaches the head of the LRU, at the
midpoint between its last use and now, while the granted nodes hold at most the cap's
tokens; past the cap it is plain LRU."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from shared.config import WorkerConfig
from tests.worker.engine.test_radix_cache import held  # no LRU touch, as a match would
from worker.backends import engine_config
from worker.engine.allocator import SlotAllocator
from worker.engine.config import EngineConfig
from worker.engine.radix_cache import RadixCache


def make(cap: int) -> RadixCache:
    return RadixCache(SlotAllocator(100), 1, cap)


def put(cache: RadixCache, tokens: list[int]) -> None:
    """One request the scheduler's way: the admission's match, lock, alloc, insert, unlock."""
    m = cache.match_prefix(tokens)
    cache.lock(m.last_node)
    new = cache.allocator.alloc(len(tokens) - m.prefix_len)
    assert new is not None
    cache.insert(tokens, np.concatenate((m.slots, new)), cached_len=m.prefix_len)
    cache.unlock(m.last_node)


def reused_then_newer(cache: RadixCache) -> None:
    """[1 1] and [2 2] cached and each matched again by an admission, then three
    one-off prompts after them: by plain LRU [1 1] and [2 2] are the oldest."""
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [1, 1])  # admissions that match [1 1] and [2 2] again: both reused
    put(cache, [2, 2])
    for t in ([3, 3], [4, 4], [5, 5]):
        put(cache, t)


def test_a_reused_prefix_outlives_newer_one_off_prompts() -> None:
    on, off = make(cap=10), make(cap=0)
    for cache in (on, off):
        reused_then_newer(cache)
        cache.evict(2)
        cache.check_integrity()
    assert [held(on, t) for t in ([1, 1], [2, 2], [3, 3])] == [2, 2, 0]  # [3 3] went
    assert [held(off, t) for t in ([1, 1], [2, 2], [3, 3])] == [0, 2, 2]  # plain LRU
    assert on.second_chance.granted == 4 and off.second_chance.granted == 0


def test_the_cap_holds_granted_tokens_and_past_it_is_plain_lru() -> None:
    cache = make(cap=2)  # room for one of the two reused prefixes
    reused_then_newer(cache)
    cache.evict(4)  # [1 1] granted (2 tokens: the cap), [2 2] past it: evicted, then [3 3]
    assert [held(cache, t) for t in ([1, 1], [2, 2], [3, 3], [4, 4])] == [2, 0, 0, 2]
    assert cache.second_chance.granted == 2
    # Aged: requeued at the midpoint between its last use and the eviction, so it went
    # after [3 3] (used before that midpoint) and goes before [4 4] (used after it).
    cache.evict(2)  # its chance spent: evicted
    assert [held(cache, t) for t in ([1, 1], [4, 4], [5, 5])] == [0, 2, 2]
    assert cache.second_chance.granted == 0
    cache.check_integrity()


def test_a_granted_prefix_reused_again_leaves_the_count_and_may_have_another() -> None:
    cache = make(cap=2)
    reused_then_newer(cache)
    cache.evict(2)  # [1 1] granted, [2 2] evicted
    assert cache.second_chance.granted == 2
    put(cache, [1, 1, 9])  # an admission matches it again: reused anew, out of the count
    assert cache.second_chance.granted == 0
    cache.check_integrity()


def test_a_split_granted_node_stays_counted_in_its_two_halves() -> None:
    cache = make(cap=4)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5])  # [1 2 3 4] reused
    cache.evict(1)  # [5]
    put(cache, [6])
    put(cache, [7])
    cache.evict(1)  # [1 2 3 4] is the LRU leaf: granted, aged past [6]; [6] goes
    assert held(cache, [6]) == 0 and held(cache, [7]) == 1
    assert cache.second_chance.granted == 4
    cache.match_prefix([1, 2, 9], record=False)  # a look-up splits it: 2 + 2, both granted
    assert cache.second_chance.granted == 4
    cache.check_integrity()


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_second_chance_share_outside_zero_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="second_chance"):
        EngineConfig(second_chance=share)


def test_the_engine_default_is_a_tenth_of_kv_and_the_worker_config_sets_it() -> None:
    assert EngineConfig().second_chance == 0.1
    assert WorkerConfig().second_chance == 0.1
    assert engine_config(WorkerConfig(second_chance=0.0)).second_chance == 0.0
    with pytest.raises(ValidationError, match="second_chance"):
        WorkerConfig(second_chance=1.5)


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="second_chance_tokens"):
        make(cap=-1)
