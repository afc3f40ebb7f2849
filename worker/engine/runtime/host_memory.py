"""Host memory for the host KV tier: what a buffer really takes, and pinning it.

Rule: the host tier's buffers are plain allocations registered with CUDA in place
(`cudaHostRegister`, as SGLang's host pool does), never `pin_memory=True`. torch's
caching host allocator rounds every pinned block up to a power of two, so a 20 GiB
tier (two 10 GiB buffers, K and V) would pin 32 GiB, 12 GiB the free-memory check
never saw. A registered allocation takes its own size, rounded up to a page.

`host_bytes` says what a buffer takes each way; `check_host_memory` refuses a tier
whose real figure does not fit; `pin_in_place` registers buffers and unregisters them
when their owner goes. On CPU nothing is pinned (`Pinning.NONE`).
"""

from __future__ import annotations

import enum
import mmap
import weakref
from typing import Any, Protocol

import torch

from worker.engine.runtime.kv_pool import cpu_available_bytes


class Pinning(enum.Enum):
    NONE = "none"  # plain pageable memory (CPU: nothing to pin for): its own size
    REGISTERED = "registered"  # a plain allocation + cudaHostRegister: its own size
    CACHING = "caching"  # torch's pin_memory=True: rounded up to a power of two


class CudaRuntime(Protocol):
    """The two calls of `torch.cuda.cudart()` used here (a stand-in in CPU tests)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, ptr: int) -> Any: ...


def host_bytes(nbytes: int, pinning: Pinning) -> int:
    """Host memory one buffer of `nbytes` takes, pinned as `pinning` says."""
    if nbytes <= 0:
        return 0
    if pinning is Pinning.CACHING:
        return 1 << (nbytes - 1).bit_length()  # the caching host allocator's block
    if pinning is Pinning.REGISTERED:
        return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages are locked
    return nbytes


def tier_host_bytes(tokens: int, bytes_per_token: int, pinning: Pinning) -> int:
    """The host tier's K and V buffers together (`bytes_per_token` counts K and V)."""
    return 2 * host_bytes(tokens * bytes_per_token // 2, pinning)


def check_host_memory(
    tokens: int,
    bytes_per_token: int,
    available: int | None = None,
    pinning: Pinning = Pinning.NONE,
) -> int:
    """Refuse a host tier the host's free memory cannot hold (ValueError with the
    numbers), counting what its buffers really take; returns that figure."""
    available = cpu_available_bytes() if available is None else available
    need = tier_host_bytes(tokens, bytes_per_token, pinning)
    if need > available:
        fit = tokens * available // need
        raise ValueError(
            f"host_cache_tokens {tokens} needs {need:,} bytes of host memory "
            f"({bytes_per_token:,} bytes per token, {pinning.value} pinning) but "
            f"{available:,} are available; at most {fit} tokens fit"
        )
    return need


def pin_in_place(owner: object, buffers: list[torch.Tensor], cudart: CudaRuntime) -> None:
    """Register each CPU buffer with CUDA (page-locked, its own size) until `owner` is
    collected; then unregister them before their memory is freed (the finalizer holds
    the buffers, so they outlive it)."""
    done: list[int] = []
    try:
        for buf in buffers:
            code = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
            done.append(buf.data_ptr())
    except BaseException:
        _unregister(cudart, done, buffers)
        raise
    weakref.finalize(owner, _unregister, cudart, done, list(buffers))


def _unregister(cudart: CudaRuntime, ptrs: list[int], buffers: list[torch.Tensor]) -> None:
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)
