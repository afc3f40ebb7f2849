"""KV pool: every layer's K and V rows for `capacity` token slots, allocated once.

One tensor per kind, `[layers, capacity + 1, kv_heads, head_dim]`; `k[layer]` and
`v[layer]` are views of it. A request's KV lives in the rows its slots name (handed
out by a SlotAllocator over [0, capacity) and shared through the radix cache), so
attention reads a request's K/V by slot index and a cached prefix is never
recomputed. Row `capacity` (`pad_slot`) is never handed out: the padding entries of
a CUDA-graph batch write their K/V there.
"""

from __future__ import annotations

import os

import torch


def cpu_available_bytes() -> int:
    """Memory the kernel could give us without swapping (MemAvailable), or free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVPool:
    """K and V preallocated once: k[layer], v[layer] each a tensor [capacity, num_kv_heads, head_dim] on `device`."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self.pad_slot = capacity
        shape = (num_layers, capacity + 1, num_kv_heads, head_dim)
        # Zeroed, not empty: a bug that reads an unwritten slot then gives zeros, not NaNs.
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = list(self.k_buffer.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_buffer.unbind(0))

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize  # K and V

    @staticmethod
    def capacity_for_memory(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        fraction: float,
    ) -> int:
        """Tokens whose K and V fit in `fraction` of the device's free memory now."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        device = torch.device(device)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
        else:
            free = cpu_available_bytes()
        per_token = KVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        return int(free * fraction) // per_token

    @property
    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows `[n, kv_heads, head_dim]` at `slots` (int64, on the pool's device)."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows `[*slots.shape, kv_heads, head_dim]` of `slots`, in order (copies).

        For tests and tools: attention reads the pool through its backend.
        """
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        k = self.k[layer].index_select(0, flat).view(shape)
        return k, self.v[layer].index_select(0, flat).view(shape)
