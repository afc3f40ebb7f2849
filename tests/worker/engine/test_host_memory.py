"""The host tier's memory is what it says (issue 32): torch's pinned allocations are
rounded up to a power of two, registered plain ones are not, and the free-memory check
counts what the buffers really take.

No GPU here: `cudaHostRegister` / `cudaHostUnregister` are stood in for by a recorder
(the one part that cannot run on CPU); the buffers, their sizes and the finalizer
that unregisters them are real.
"""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from worker.engine.runtime.host_memory import (
    Pinning,
    check_host_memory,
    host_bytes,
    pin_in_place,
    tier_host_bytes,
)
from worker.engine.runtime.host_pool import HostKVPool
from worker.engine.runtime.kv_pool import KVPool

GIB = 2**30


def test_a_20_gib_tier_pins_32_gib_through_the_caching_allocator_and_20_registered() -> None:
    # Two 10 GiB buffers (K and V): the caching host allocator gives each a 16 GiB block.
    assert tier_host_bytes(20 * GIB // 1000, 1000, Pinning.CACHING) == 32 * GIB
    assert tier_host_bytes(20 * GIB // 1000, 1000, Pinning.REGISTERED) == 20 * GIB
    assert host_bytes(10 * GIB + 1, Pinning.REGISTERED) == 10 * GIB + mmap.PAGESIZE
    assert host_bytes(10 * GIB, Pinning.NONE) == 10 * GIB
    assert host_bytes(0, Pinning.CACHING) == 0


def test_the_free_memory_check_counts_the_real_figure() -> None:
    tokens, per_token = 20 * GIB // 1000, 1000
    available = 24 * GIB  # enough for 20 GiB registered, not for the 32 GiB it would pin
    assert check_host_memory(tokens, per_token, available, Pinning.REGISTERED) == 20 * GIB
    with pytest.raises(ValueError, match=r"needs 34,359,738,368 bytes .* caching pinning"):
        check_host_memory(tokens, per_token, available, Pinning.CACHING)


class FakeCudart:
    """Records registrations by pointer and size; unregistering removes them."""

    def __init__(self, fail: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail and self.registered:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0


def test_buffers_are_registered_at_their_own_size_until_their_owner_goes() -> None:
    class Owner:
        pass

    cudart, owner = FakeCudart(), Owner()
    k, v = torch.empty(1000, 3, dtype=torch.bfloat16), torch.empty(777, dtype=torch.uint8)
    pin_in_place(owner, [k, v], cudart)
    assert cudart.registered == {k.data_ptr(): 6000, v.data_ptr(): 777}
    del owner
    gc.collect()
    assert cudart.registered == {}  # unregistered when the pool went


def test_a_failed_registration_undoes_the_others() -> None:
    cudart = FakeCudart(fail=True)
    with pytest.raises(RuntimeError, match="cudaHostRegister failed with CUDA error 2"):
        pin_in_place(object(), [torch.empty(8), torch.empty(8)], cudart)
    assert cudart.registered == {}


def test_the_host_pool_reports_and_checks_what_it_takes() -> None:
    pool = KVPool(2, 2, 16, 64, torch.float32, torch.device("cpu"))
    host = HostKVPool(pool, 100)
    assert host.pinning is Pinning.NONE  # CPU: nothing pinned
    assert host.host_bytes == host.k.nbytes + host.v.nbytes == 100 * host.bytes_per_token
