"""Fused elementwise ops of a decoder layer: fewer launches, one pass over memory each.

    add_rmsnorm  residual + x, then RMSNorm of the sum (the sum is the new residual)
    rope_store   RoPE on q and k in place, then k and v stored into the KV pool at the
                 new tokens' slots (quantized to fp8 by the pool's per-tensor scales
                 when the pool is fp8)
    silu_mul     silu(gate) * up

Two implementations behind one interface, chosen with the attention backend
(runner.py: `ops_for`): `TorchOps` here (the reference: the eager ops the model always ran; CPU
without the interpreter) and `TritonOps` in fused_kernels.py (one kernel each; CUDA,
and CPU under TRITON_INTERPRET=1 for the tests; imported only when chosen, so the
engine runs without triton installed). The kernels round where the eager ops round (the
RMSNorm output is cast to the activation dtype before the weight multiplies it, as
transformers does), so in fp32 they agree with the reference to float rounding and in
bf16 to one rounding step (tests/worker/engine/test_fused_ops.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, written into x (`cos`/`sin` are [T, 1, dim/2]).

    The same products and sums as transformers' form, so fp32 results match; it saves
    the concatenated copies (three temporaries of x's size per call).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x2_sin = x2 * sin
    x2.mul_(cos).add_(x1 * sin)
    x1.mul_(cos).sub_(x2_sin)
    return x


class Ops(Protocol):
    """What the model calls; TorchOps and fused_kernels.TritonOps both are one."""

    name: str

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def rope_store(
        self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: Any, layer: int, slots: torch.Tensor, heads: int,
    ) -> None: ...  # fmt: skip


class TorchOps:
    """The reference: the eager ops (several launches each)."""

    name = "torch"

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype), x

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def rope_store(
        self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: Any, layer: int, slots: torch.Tensor, heads: int,
    ) -> None:  # fmt: skip
        """RoPE on qk [T, heads + kv_heads, dim] in place, then k = qk[:, heads:] and v
        into the pool."""
        apply_rope_(qk, cos, sin)
        kv.write(layer, slots, qk[:, heads:], v)


TORCH_OPS = TorchOps()
