"""What the GPU check's kernel sections share (loadtests/gpu/gpu_ops.py,
loadtests/gpu/gpu_baseline.py): a timer that synchronises the device, a batch of
(cached, new) items over permuted pool slots, and a pool of random K/V."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.engine.batch import BatchItem
from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step
from worker.engine.runtime.kv_pool import KVPool


def time_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median microseconds of `fn` (warm-up calls first: compiles, caches; one on CPU,
    where the kernels run in the interpreter and nothing is compiled)."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def batch_slots(capacity: int, items: list[tuple[int, int]]) -> list[np.ndarray]:
    """Each (cached tokens, new tokens) item's slots, drawn from the permuted pool."""
    free, used, out = np.random.default_rng(0).permutation(capacity), 0, []
    for start, n in items:
        out.append(free[used : used + start + n].astype(np.int64))
        used += start + n
    return out


def make_batch(device: torch.device, s: dict, items: list[tuple[int, int]], capacity: int):
    """Metadata of a batch of (cached tokens, new tokens) items over permuted slots."""
    batch = [BatchItem([1] * n, start, slots)
             for (start, n), slots in zip(items, batch_slots(capacity, items), strict=True)]  # fmt: skip
    width = max(a + b for a, b in items)
    table = ReqToTokenTable(len(items), width, device)
    return build_step(batch, list(range(len(items))), table, Staging(device)).meta


def random_pool(device: torch.device, s: dict, capacity: int, kv_dtype: torch.dtype | None,
                dtype: torch.dtype) -> KVPool:  # fmt: skip
    pool = KVPool(1, s["kv_heads"], s["dim"], capacity, dtype, device, kv_dtype=kv_dtype)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (capacity, s["kv_heads"], s["dim"])
    pool.write(0, torch.arange(capacity, device=device),
               torch.randn(shape, generator=g, device=device, dtype=dtype),
               torch.randn(shape, generator=g, device=device, dtype=dtype))  # fmt: skip
    return pool
