"""KV pool: every layer's K and V rows for `capacity` token slots, allocated once.

One tensor per kind, `[layers, capacity + 1, kv_heads, head_dim]`; `k[layer]` and
`v[layer]` are views of it. A request's KV lives in the rows its slots name (handed
out by a SlotAllocator over [0, capacity) and shared through the radix cache), so
attention reads a request's K/V by slot index and a cached prefix is never
recomputed. Row `capacity` (`pad_slot`) is never handed out: the padding entries of
a CUDA-graph batch write their K/V there.

An fp8 pool (`kv_dtype=torch.float8_e4m3fn`, `--kv-cache-dtype fp8_e4m3`) stores each
value divided by a per-tensor scale (one for K and one for V per layer), clamped to
e4m3's +-448, in one byte: half the bytes of bf16 per token, so twice the tokens in
the same memory and half the KV bytes a decode step reads. Reads multiply the scale
back (the attention backends do it as they load). The scales are 1.0 unless set
(`set_scales`), which is what vLLM and SGLang use for a checkpoint without
calibrated KV scales; real models' K/V after RoPE sit well inside +-448.
"""

from __future__ import annotations

import torch

from worker.engine.free_memory import cpu_available_bytes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes): torch's CPU index_copy_/index_select have no
    fp8 kernels; a copy of bytes is the same copy."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buffer.index_select(0, slots), fp8 included."""
    return as_bytes(buffer).index_select(0, slots).view(buffer.dtype)


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
        *,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the activations'; `kv_dtype`: what the pool stores (default: the same;
        torch.float8_e4m3fn: fp8 with per-tensor scales)."""
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
        self.compute_dtype = dtype
        self.dtype = kv_dtype or dtype  # what is stored
        self.quantized = self.dtype == torch.float8_e4m3fn
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.device = torch.device(device)
        self.pad_slot = capacity
        shape = (num_layers, capacity + 1, num_kv_heads, head_dim)
        # Zeroed, not empty: a bug that reads an unwritten slot then gives zeros, not NaNs.
        self.k_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
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

    def set_scales(self, k_scale: list[float], v_scale: list[float]) -> None:
        """Per-layer per-tensor scales of an fp8 pool; set before anything is stored."""
        if len(k_scale) != self.num_layers or len(v_scale) != self.num_layers:
            raise ValueError(f"one K and one V scale per layer ({self.num_layers})")
        if min(*k_scale, *v_scale) <= 0:
            raise ValueError("KV scales must be positive")
        self.k_scale, self.v_scale = list(k_scale), list(v_scale)

    def scales(self, layer: int) -> tuple[float, float] | None:
        """(k, v) scales of an fp8 pool's layer; None when the pool is not quantized."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else None

    def all_scales(self) -> list[tuple[float, float]] | None:
        if not self.quantized:
            return None
        return list(zip(self.k_scale, self.v_scale, strict=True))

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.quantized:
            return x.to(self.dtype)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(self.dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows `[n, kv_heads, head_dim]` at `slots` (int64, on the pool's device)."""
        as_bytes(self.k[layer]).index_copy_(0, slots, as_bytes(self._store(k, self.k_scale[layer])))
        as_bytes(self.v[layer]).index_copy_(0, slots, as_bytes(self._store(v, self.v_scale[layer])))

    def load(self, layer: int, buffer: torch.Tensor, slots: torch.Tensor, v: bool) -> torch.Tensor:
        """Rows of `buffer` (k[layer] or v[layer]) at `slots`, in the activations' dtype."""
        rows = gather_rows(buffer, slots)
        if not self.quantized:
            return rows
        scale = self.v_scale[layer] if v else self.k_scale[layer]
        return (rows.float() * scale).to(self.compute_dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows `[*slots.shape, kv_heads, head_dim]` of `slots`, in order (copies).

        For tests and tools: attention reads the pool through its backend.
        """
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        k = self.load(layer, self.k[layer], flat, v=False).view(shape)
        return k, self.load(layer, self.v[layer], flat, v=True).view(shape)
