"""The host KV pool: K and V of the host tier's slots, and the copies to and from it.

The radix cache plans which pages move (worker/engine/host_tier.py); this module makes
one step's copies, all write-backs (device -> host) then all loads (host -> device):

    write-back  gather the device rows on the device (one index_select per K and V)
                -> one copy per run of consecutive host slots into host memory
    load        one copy per run of consecutive host slots into a device buffer
                -> scatter into the device slots (one index_copy_ per K and V)

Host rows are token-major (`[capacity, layers, kv_heads, head_dim]`, SGLang's
"page_first" layout), so a run of host slots is one contiguous block and its copy one
DMA. On CUDA the host memory is pinned (a plain allocation registered in place,
worker/engine/runtime/host_memory.py: pin_memory=True would round each buffer up to a
power of two) and every copy is `non_blocking` on the pool's
own stream: the stream first waits for the compute stream (the forward that wrote the
rows, or last read freed ones), the compute stream then waits for the copies through
an event before the step's forward. The host never waits: no synchronize, no `.item()`,
no per-page sync; the copies overlap the host's work on the step (building its
inputs) and whatever the device still runs. Load bandwidth is timed with CUDA events
read once complete (`query()`, never a wait). On CPU the same code runs on plain
tensors (the copies are real, only cheaper) and is timed with the clock.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from worker.engine.runtime.host_memory import Pinning, check_host_memory, pin_in_place
from worker.engine.runtime.kv_pool import KVPool
from worker.engine.types import KVCopies

__all__ = ["HostKVPool", "check_host_memory"]


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, first slot) of each run of consecutive slots in `idx`."""
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.concatenate([breaks, [len(idx)]]).astype(np.int64)
    return list(zip(starts.tolist(), ends.tolist(), idx[starts].tolist(), strict=True))


class HostKVPool:
    """K and V rows for `capacity` host slots beside a device `KVPool`."""

    def __init__(self, device_pool: KVPool, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"host pool capacity must be positive, got {capacity}")
        self.device_pool = dp = device_pool
        self.capacity = capacity
        self.bytes_per_token = KVPool.bytes_per_token(
            dp.num_layers, dp.num_kv_heads, dp.head_dim, dp.dtype
        )
        self.cuda = dp.device.type == "cuda"
        self.pinning = Pinning.REGISTERED if self.cuda else Pinning.NONE
        # What the buffers really take (host_memory.py), checked before allocating.
        self.host_bytes = check_host_memory(capacity, self.bytes_per_token, pinning=self.pinning)
        shape = (capacity, dp.num_layers, dp.num_kv_heads, dp.head_dim)
        # Not zeroed: a host slot is always written before it is read, and touching
        # tens of GB at start would take seconds.
        # An fp8 pool is copied as its bytes (index ops on float8 are not everywhere):
        # its per-tensor scales are per layer, not per token, so nothing else moves.
        fp8 = dp.k_buffer.element_size() == 1
        self._store = torch.uint8 if fp8 else dp.dtype
        self._dev = [b.view(torch.uint8) if fp8 else b for b in (dp.k_buffer, dp.v_buffer)]
        self.k = torch.empty(shape, dtype=self._store)
        self.v = torch.empty(shape, dtype=self._store)
        if self.cuda:
            pin_in_place(self, [self.k, self.v], torch.cuda.cudart())
        self.stream = torch.cuda.Stream(dp.device) if self.cuda else None
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()
        self.load_bytes = 0  # timed loads so far
        self.load_seconds = 0.0

    @property
    def load_bytes_per_s(self) -> float:
        """Measured host -> device bandwidth of the loads timed so far (0.0: none yet)."""
        self._collect()
        return self.load_bytes / self.load_seconds if self.load_seconds > 0 else 0.0

    @torch.inference_mode()
    def copy(self, copies: KVCopies) -> None:
        if self.stream is None:
            self._write(copies.write_device, copies.write_host)
            t0 = time.perf_counter()
            self._load(copies.load_host, copies.load_device)
            if copies.load_tokens:
                self.load_seconds += time.perf_counter() - t0
                self.load_bytes += copies.load_tokens * self.bytes_per_token
            return
        self._collect()
        compute = torch.cuda.current_stream(self.device_pool.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._write(copies.write_device, copies.write_host)
            if copies.load_tokens:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                self._load(copies.load_host, copies.load_device)
                end.record(self.stream)
                self._timings.append((start, end, copies.load_tokens * self.bytes_per_token))
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)

    def _collect(self) -> None:
        """Add the timings of loads that have finished (query: never waits)."""
        while self._timings and self._timings[0][1].query():
            start, end, nbytes = self._timings.popleft()
            self.load_seconds += start.elapsed_time(end) / 1e3
            self.load_bytes += nbytes

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device_pool.device, non_blocking=True)

    def _write(self, device_slots: np.ndarray, host_slots: np.ndarray) -> None:
        if not len(host_slots):
            return
        idx = self._index(device_slots)
        runs = _runs(host_slots)
        for dev_buf, host_buf in zip(self._dev, (self.k, self.v), strict=True):
            rows = dev_buf.index_select(1, idx).transpose(0, 1).contiguous()  # token-major
            for a, b, h in runs:
                host_buf[h : h + b - a].copy_(rows[a:b], non_blocking=self.cuda)

    def _load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None:
        if not len(host_slots):
            return
        idx = self._index(device_slots)
        runs = _runs(host_slots)
        device = self.device_pool.device
        for dev_buf, host_buf in zip(self._dev, (self.k, self.v), strict=True):
            rows = torch.empty(
                (len(host_slots), *host_buf.shape[1:]), dtype=self._store, device=device
            )
            for a, b, h in runs:
                rows[a:b].copy_(host_buf[h : h + b - a], non_blocking=self.cuda)
            dev_buf.index_copy_(1, idx, rows.transpose(0, 1))
