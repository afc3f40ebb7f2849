"""SlotAllocator: a free list that never hands one slot out twice and never leaks one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.allocator import SlotAllocator


def test_fresh_allocator_hands_out_ascending_slots() -> None:
    a = SlotAllocator(10)
    assert a.capacity == 10 and a.available == 10
    got = a.alloc(4)
    assert got is not None and got.dtype == np.int64
    assert got.tolist() == [0, 1, 2, 3]
    assert a.available == 6
    a.check_integrity(owned=got)


def test_alloc_too_many_takes_nothing() -> None:
    a = SlotAllocator(5)
    first = a.alloc(3)
    assert a.alloc(3) is None
    assert a.available == 2
    a.check_integrity(owned=first)


def test_alloc_zero_and_free_empty() -> None:
    a = SlotAllocator(3)
    got = a.alloc(0)
    assert got is not None and len(got) == 0
    a.free(np.empty(0, dtype=np.int64))
    assert a.available == 3


def test_returned_array_is_independent_of_the_free_list() -> None:
    a = SlotAllocator(4)
    got = a.alloc(2)
    assert got is not None
    got[:] = 99  # the caller's copy; the allocator's state must not change
    a.free(np.array([0, 1]))
    a.check_integrity()
    assert sorted(a.free_slots().tolist()) == [0, 1, 2, 3]


def test_free_then_realloc_reuses_slots() -> None:
    a = SlotAllocator(4)
    x = a.alloc(4)
    assert x is not None
    a.free(x[1:3])
    y = a.alloc(2)
    assert y is not None and sorted(y.tolist()) == [1, 2]
    assert a.alloc(1) is None


def test_double_free_beyond_capacity_is_refused() -> None:
    a = SlotAllocator(2)
    with pytest.raises(ValueError, match="freeing"):
        a.free(np.array([0]))


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        SlotAllocator(-1)
    with pytest.raises(ValueError):
        SlotAllocator(3).alloc(-1)


def test_integrity_detects_duplicates_leaks_and_overlap() -> None:
    a = SlotAllocator(4)
    x = a.alloc(2)
    assert x is not None
    a.free(x[:1])
    a.free(x[:1])  # double free that still fits in the stack
    with pytest.raises(AssertionError, match="free twice"):
        a.check_integrity()
    b = SlotAllocator(4)
    y = b.alloc(2)
    assert y is not None
    with pytest.raises(AssertionError, match="leaked"):
        b.check_integrity(owned=y[:1])
    with pytest.raises(AssertionError, match="both free and owned"):
        b.check_integrity(owned=np.array([0, 1, 2]))


def test_reset_frees_everything() -> None:
    a = SlotAllocator(6)
    a.alloc(5)
    a.reset()
    assert a.available == 6
    a.check_integrity(owned=np.empty(0, dtype=np.int64))


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40))
def test_random_alloc_free_keeps_a_partition(ops: list[tuple[bool, int]]) -> None:
    """Against a set model: held ∪ free is always every slot, and alloc never repeats one."""
    a = SlotAllocator(16)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc(n)
            if n > 16 - len(held):
                assert got is None
            else:
                assert got is not None and len(got) == n
                assert not set(got.tolist()) & set(held)
                held += got.tolist()
        else:
            give, held = held[:n], held[n:]
            a.free(np.array(give, dtype=np.int64))
        assert a.available == 16 - len(held)
        a.check_integrity(owned=np.array(held, dtype=np.int64))
