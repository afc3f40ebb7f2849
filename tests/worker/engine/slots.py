"""One slot allocator per runner for the runner-level tests: the engine builds its own
over [0, runner.capacity); tests that drive a runner directly do the same here."""

from __future__ import annotations

import weakref
from typing import Any

from worker.engine.allocator import SlotAllocator

_ALLOCATORS: weakref.WeakKeyDictionary[Any, SlotAllocator] = weakref.WeakKeyDictionary()


def allocator_for(runner: Any) -> SlotAllocator:
    if runner not in _ALLOCATORS:
        _ALLOCATORS[runner] = SlotAllocator(runner.capacity)
    return _ALLOCATORS[runner]
