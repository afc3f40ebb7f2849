"""The host tier's bookkeeping: host slots, and the copies one step must make.

Pure numpy, like the scheduler: the radix cache decides which pages move between the
device pool and the host pool (a write-back when the device LRU evicts a page, a load
when a match reaches host-resident pages) and records them here; once per step the
engine takes the plan (`take`) and the runner makes the copies, all write-backs in one
batched copy and then all loads in one (worker/engine/runtime/host_pool.py does the tensors).

Why one plan per step is safe without ordering the copies one by one:

- a write-back reads device slots that the same step may hand to a load or a prefill:
  write-backs run first, and the runner runs the step's forward after both;
- a load reads host slots: a node with a copy in this step's plan (`epoch`) is never
  dropped from the host tier in the same step, so no later write-back of the step
  reuses its host slots (the host LRU skips it until the plan is taken);
- two write-backs of one step never share a host slot for the same reason.
"""

from __future__ import annotations

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.types import KVCopies


def _cat(runs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(runs) if runs else np.empty(0, dtype=np.int64)


class HostTier:
    """Host slots [0, capacity) and the copy plan being built for the next step."""

    def __init__(self, capacity: int, write_through: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity}")
        self.allocator = SlotAllocator(capacity)
        self.write_through = write_through  # back up every new node at insert, not at eviction
        self.epoch = 1  # the plan being built; a node's `copy_epoch` marks a copy in it
        self._writes: list[tuple[np.ndarray, np.ndarray]] = []
        self._loads: list[tuple[np.ndarray, np.ndarray]] = []
        # Counters (tokens): what the stats and /metrics report.
        self.written_tokens = 0
        self.loaded_tokens = 0
        self.dropped_tokens = 0  # host copies dropped for room (the host LRU)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.capacity - self.allocator.available

    def write(self, device: np.ndarray, host: np.ndarray) -> None:
        self._writes.append((device, host))
        self.written_tokens += len(host)

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        self._loads.append((host, device))
        self.loaded_tokens += len(device)

    def take(self) -> KVCopies | None:
        """The plan built since the last call (None when empty); a new plan starts."""
        self.epoch += 1
        if not self._writes and not self._loads:
            return None
        writes, loads = self._writes, self._loads
        self._writes, self._loads = [], []
        return KVCopies(
            _cat([d for d, _ in writes]),
            _cat([h for _, h in writes]),
            _cat([h for h, _ in loads]),
            _cat([d for _, d in loads]),
        )

    def drop_writes(self) -> None:
        """Forget pending write-backs (flush: no host copy survives, so none is needed)."""
        self._writes = []
