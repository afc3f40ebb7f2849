"""The triton kernels of the fused ops (fused_ops.py has the interface, the eager
reference and why): add+RMSNorm, RoPE+KV store (fp8 pools quantized on the way in),
SiLU*mul, one launch each. Only the plain `tl` subset is used (triton 3.6 on the GPU
machine, the interpreter in the tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from worker.engine.runtime.attention.triton_compat import patch_interpreter

patch_interpreter()


@triton.jit
def _add_rmsnorm_kernel(
    X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, n, eps,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # the sum rounds to the activation dtype first, as the eager `x + residual`
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(
            tl.float32)).to(X.dtype.element_ty)  # fmt: skip
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n + eps)
    y = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * y).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, OUT, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # F.silu rounds
    tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _to_e4m3_grid(x):
    """x / scale (fp32, already clamped to +-448) rounded to the nearest e4m3 value, so
    the cast that follows is exact. Done by hand because triton's interpreter casts
    fp32 -> fp8 wrongly where rounding carries into the next power of two (127.8 ->
    64); on the GPU the result is the cast's own round-to-nearest (ties aside)."""
    mag = tl.abs(x)
    e = tl.floor(tl.log2(tl.maximum(mag, 1e-30)))
    step = tl.exp2(tl.maximum(e, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
    return tl.where(x < 0, -1.0, 1.0) * tl.floor(mag / step + 0.5) * step


@triton.jit
def _rope_store_kernel(
    QK, V, COS, SIN, K_BUF, V_BUF, SLOTS,
    stride_t, stride_h, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kb, stride_kbh, stride_vb, stride_vbh, k_scale, v_scale,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < HEADS + KV_HEADS) & (d[None, :] < HALF)
    base = QK + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(COS + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + t * stride_st + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    y1 = (x1 * cos - x2 * sin).to(QK.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(QK.dtype.element_ty)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    # k heads (rows HEADS.. of the tile) and v go to the pool row of this token's slot
    slot = tl.load(SLOTS + t).to(tl.int64)
    kv = h - HEADS
    kmask = mask & (h[:, None] >= HEADS)
    dst = K_BUF + slot * stride_kb + kv[:, None] * stride_kbh + d[None, :]
    if QUANT:  # the pool's fp8: value / scale, clamped to e4m3's +-448 (kv_pool.py)
        k1 = _to_e4m3_grid(tl.minimum(tl.maximum(y1.to(tl.float32) / k_scale, -448.0), 448.0))
        k2 = _to_e4m3_grid(tl.minimum(tl.maximum(y2.to(tl.float32) / k_scale, -448.0), 448.0))
        tl.store(dst, k1.to(K_BUF.dtype.element_ty), mask=kmask)
        tl.store(dst + HALF, k2.to(K_BUF.dtype.element_ty), mask=kmask)
    else:
        tl.store(dst, y1.to(K_BUF.dtype.element_ty), mask=kmask)
        tl.store(dst + HALF, y2.to(K_BUF.dtype.element_ty), mask=kmask)
    j = tl.arange(0, BLOCK_KV)
    dv = tl.arange(0, 2 * BLOCK_HALF)
    vmask = (j[:, None] < KV_HEADS) & (dv[None, :] < 2 * HALF)
    v = tl.load(V + t * stride_vt + j[:, None] * stride_vh + dv[None, :], mask=vmask, other=0.0)
    if QUANT:
        v = _to_e4m3_grid(tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0))
    tl.store(V_BUF + slot * stride_vb + j[:, None] * stride_vbh + dv[None, :],
             v.to(V_BUF.dtype.element_ty), mask=vmask)  # fmt: skip


class TritonOps:
    """One triton kernel per op."""

    name = "triton"

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = x.shape
        out = torch.empty_like(x)
        res = torch.empty_like(x) if residual is not None else x
        r = residual if residual is not None else x
        block = triton.next_power_of_2(n)
        _add_rmsnorm_kernel[(t,)](
            x, r, weight, out, res, x.stride(0), r.stride(0), out.stride(0), res.stride(0),
            n, eps, BLOCK=block, HAS_RES=residual is not None,
            num_warps=min(16, max(4, block // 512)),
        )  # fmt: skip
        return out, res

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        t, n = gate.shape
        out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n, BLOCK=block
        )
        return out

    def rope_store(
        self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: Any, layer: int, slots: torch.Tensor, heads: int,
    ) -> None:  # fmt: skip
        t, rows, dim = qk.shape
        kv_heads = rows - heads
        k_buf, v_buf = kv.k[layer], kv.v[layer]
        scales = kv.scales(layer)
        k_scale, v_scale = scales or (1.0, 1.0)
        assert qk.stride(2) == 1 and v.stride(2) == 1 and cos.stride(-1) == 1
        _rope_store_kernel[(t,)](
            qk, v, cos, sin, k_buf, v_buf, slots,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            k_scale, v_scale,
            HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(rows),
            BLOCK_HALF=triton.next_power_of_2(dim // 2), BLOCK_KV=triton.next_power_of_2(kv_heads), QUANT=scales is not None,
        )  # fmt: skip
