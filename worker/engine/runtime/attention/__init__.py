"""Attention backends behind one seam, and the batch metadata they share.

    sdpa    the reference: PyTorch SDPA per sequence over K/V read through the slot
            table. The CPU default (measured fastest there, see sdpa.py).
    triton  our paged kernels (triton_kernels.py): decode and extend read K/V through
            the request->token table on the device, no gather, GQA without repeat.
            The CUDA default; also runs on CPU under TRITON_INTERPRET=1 (tests).

A backend gets the new tokens' q/k/v of one layer (their K/V already written to the
pool) and the step's `AttentionMetadata`, and returns the attention output [T, H, D].
"""

from __future__ import annotations

import os

import torch

from worker.engine.runtime.attention.metadata import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "sdpa", "triton")


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA, sdpa elsewhere; triton must be importable when asked for."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "sdpa"
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "attention backend 'triton' needs the triton package: pip install '.[triton]'"
            ) from exc
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention backend 'triton' runs on CUDA; on CPU only under TRITON_INTERPRET=1 "
                "(the interpreter: slow, for tests)"
            )
    return name


def make_backend(
    name: str,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    *,
    num_heads: int,
    head_dim: int,
    sliding_window: int | None,
    device: torch.device,
    kv_scales: list[tuple[float, float]] | None = None,
) -> AttentionBackend:
    """The backend `name` (already resolved) over the pool's per-layer K/V buffers
    (`kv_scales`: per layer (k, v) scales of an fp8 pool, None when not quantized)."""
    window = sliding_window or 0
    if name == "sdpa":
        from worker.engine.runtime.attention.sdpa import SdpaBackend

        return SdpaBackend(
            k_buffers, v_buffers, head_dim=head_dim, window=window, kv_scales=kv_scales
        )
    from worker.engine.runtime.attention.triton_backend import TritonBackend

    return TritonBackend(
        k_buffers, v_buffers, num_heads=num_heads, head_dim=head_dim, window=window,
        device=device, kv_scales=kv_scales,
    )  # fmt: skip


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "make_backend", "resolve_backend"]
