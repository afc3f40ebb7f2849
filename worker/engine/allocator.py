"""KV slot allocator: a free list of slot indices in one numpy array.

A slot is one token's row in every layer of the KV pool. The free list is a stack
kept in a preallocated int64 array: `alloc(n)` pops the top `n` entries and `free`
pushes them back, each a single vectorised copy, so no Python object exists per
token on the hot path (the radix cache allocates and frees thousands of slots per
request).
"""

from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Free list of KV slot indices [0, capacity). numpy-backed stack, no per-token Python objects."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._stack = np.empty(capacity, dtype=np.int64)
        self._top = 0  # _stack[:_top] are the free slots; the top of the stack is the end
        self.reset()

    @property
    def available(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free slots as a new int64 array, or None (taking nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._top:
            return None
        top = self._top - n
        self._top = top
        # Reversed so that a fresh allocator hands out ascending, contiguous slots,
        # which keeps a request's first KV rows adjacent in memory.
        return self._stack[top : top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        """Give slots back. The caller must own them; `check_integrity` catches double frees."""
        n = len(slots)
        if n == 0:
            return
        top = self._top
        if top + n > self.capacity:
            # More slots returned than were ever out: a double free. Refuse before the
            # stack overflows, since a silent one would hand one slot to two requests.
            raise ValueError(f"freeing {n} slots with only {self.capacity - top} allocated")
        self._stack[top : top + n] = slots
        self._top = top + n

    def reset(self) -> None:
        """Every slot free again (the caller must drop every slot it held)."""
        self._stack[:] = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self._top = self.capacity

    def free_slots(self) -> np.ndarray:
        """A copy of the free list (for integrity checks and tests)."""
        return self._stack[: self._top].copy()

    def check_integrity(self, owned: np.ndarray | None = None) -> None:
        """Assert the free list is sane; with `owned`, that free and owned partition all slots.

        Raises AssertionError on: a free slot out of range, a slot free twice, and (with
        `owned`) a slot both free and owned, owned twice, or neither (leaked).
        """
        free = self._stack[: self._top]
        assert 0 <= self._top <= self.capacity, f"free count {self._top} out of range"
        if len(free):
            assert free.min() >= 0 and free.max() < self.capacity, "free slot out of range"
        counts = np.bincount(free, minlength=self.capacity)
        assert counts.max(initial=0) <= 1, f"slots free twice: {np.flatnonzero(counts > 1)[:10]}"
        if owned is None:
            return
        owned = np.asarray(owned, dtype=np.int64)
        if len(owned):
            assert owned.min() >= 0 and owned.max() < self.capacity, "owned slot out of range"
        counts += np.bincount(owned, minlength=self.capacity)
        twice = np.flatnonzero(counts > 1)
        assert len(twice) == 0, f"slots both free and owned, or owned twice: {twice[:10]}"
        leaked = np.flatnonzero(counts == 0)
        assert len(leaked) == 0, f"slots neither free nor owned (leaked): {leaked[:10]}"
