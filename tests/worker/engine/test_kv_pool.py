"""KVPool: rows written at slots read back at those slots, through the radix cache too."""

from __future__ import annotations

import pytest
import torch

from worker.engine.allocator import SlotAllocator
from worker.engine.radix_cache import RadixCache
from worker.engine.runtime.kv_pool import KVPool, cpu_available_bytes

CPU = torch.device("cpu")


def pool(
    capacity: int = 16, dtype: torch.dtype = torch.float32, device: torch.device = CPU
) -> KVPool:
    return KVPool(
        num_layers=2, num_kv_heads=2, head_dim=4, capacity=capacity, dtype=dtype, device=device
    )


def rows(n: int, seed: int, device: torch.device = CPU) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, generator=g).to(device)


def test_shapes_and_views() -> None:
    p = pool()
    assert p.capacity == 16 and not hasattr(p, "allocator")  # the engine builds its own
    assert len(p.k) == len(p.v) == 2
    # One row past capacity: the pad slot CUDA-graph padding writes to.
    assert p.k[1].shape == (17, 2, 4) and p.k_buffer.shape == (2, 17, 2, 4)
    assert p.pad_slot == 16
    p.k[1][3] = 7.0  # the per-layer tensors are views of the one buffer
    assert bool((p.k_buffer[1, 3] == 7.0).all())
    assert p.nbytes == 2 * 2 * 17 * 2 * 4 * 4


def test_write_then_read_by_slot_leaves_other_rows_alone() -> None:
    p = pool()
    slots = torch.tensor([9, 2, 5])
    k, v = rows(3, 0), rows(3, 1)
    p.write(1, slots, k, v)
    rk, rv = p.read(1, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    rk2, _ = p.read(1, torch.tensor([5, 9]))
    assert torch.equal(rk2, k[[2, 0]])
    assert not p.k[0].any() and not p.k[1][[0, 1, 3]].any()  # layer 0 and other slots untouched


def test_write_casts_to_the_pool_dtype() -> None:
    p = pool(dtype=torch.bfloat16)
    k = rows(2, 3)
    p.write(0, torch.tensor([0, 1]), k, k)
    got, _ = p.read(0, torch.tensor([0, 1]))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), k, atol=0.05)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KVPool(1, 1, 1, 0, torch.float32, CPU)
    with pytest.raises(ValueError, match="fraction"):
        KVPool.capacity_for_memory(1, 1, 1, torch.float32, CPU, fraction=0)


def test_capacity_for_memory_on_cpu_follows_available_memory() -> None:
    per_token = KVPool.bytes_per_token(4, 2, 64, torch.float16)
    assert per_token == 2 * 4 * 2 * 64 * 2
    cap = KVPool.capacity_for_memory(4, 2, 64, torch.float16, CPU, fraction=0.01)
    expected = int(cpu_available_bytes() * 0.01) // per_token
    assert cap > 0
    assert abs(cap - expected) <= expected * 0.2  # MemAvailable moves a little between reads


def test_cached_prefix_kv_is_read_back_for_a_new_request() -> None:
    """The point of the pool: a second request reads the first one's K/V through the tree."""
    p = pool(capacity=32)
    alloc = SlotAllocator(p.capacity)
    cache = RadixCache(alloc)
    first = [5, 6, 7, 8, 9]
    slots = alloc.alloc(len(first))
    assert slots is not None
    k, v = rows(5, 10), rows(5, 11)
    for layer in range(2):
        p.write(layer, torch.from_numpy(slots), k, v)
    cache.insert(first, slots)
    m = cache.match_prefix([5, 6, 7, 1])
    assert m.prefix_len == 3
    rk, rv = p.read(1, torch.from_numpy(m.slots))
    assert torch.equal(rk, k[:3]) and torch.equal(rv, v[:3])
    cache.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pool_on_cuda() -> None:
    cuda = torch.device("cuda")
    cap = KVPool.capacity_for_memory(2, 2, 4, torch.float16, cuda, fraction=0.001)
    free, _ = torch.cuda.mem_get_info(cuda)
    assert cap == int(free * 0.001) // KVPool.bytes_per_token(2, 2, 4, torch.float16)
    p = pool(capacity=64, dtype=torch.float16, device=cuda)
    assert p.k[0].device.type == "cuda"
    slots = torch.tensor([3, 1], device=cuda)
    k = rows(2, 4, cuda).half()
    p.write(0, slots, k, k)
    got, _ = p.read(0, slots)
    assert torch.equal(got, k)


def test_read_keeps_the_shape_of_a_2d_slot_index() -> None:
    p = pool()
    k = rows(4, 5)
    p.write(0, torch.tensor([0, 1, 2, 3]), k, k)
    got, _ = p.read(0, torch.tensor([[3, 0], [1, 1]]))
    assert got.shape == (2, 2, 2, 4)
    assert torch.equal(got[0, 0], k[3]) and torch.equal(got[1, 1], k[1])
