"""Paged attention kernels over the token-granular KV pool (page size 1).

Both kernels read K/V through the request->token table (`req_to_token[row, pos]` =
the pool slot of token `pos` of the sequence in `row`), so nothing is gathered into
contiguous tensors and the KV heads are never repeated for grouped-query attention.

- decode: one query token per sequence. Flash-decoding: the context is cut into
  pieces, each program reduces one piece for one KV head and ALL the query heads that
  share it (the K/V tile is loaded once per group), then a second kernel merges the
  pieces by their log-sum-exp. The grid has `num_splits` pieces per sequence (a
  function of the batch size only: what a CUDA graph needs); each sequence uses as
  many of them as its own length calls for (one per `min_split_len` keys), so a
  short sequence is not cut into slivers and a long one gets every piece. The loop
  over a piece's tiles is software-pipelined (`num_stages`: the next tiles' table
  and K/V loads are issued while the current one is reduced).
- extend: the new tokens of each sequence attend to its cached prefix and causally to
  themselves, all through the table (their K/V are written to the pool first); one
  launch covers every sequence of the batch (varlen: a program per sequence, KV head
  and block of new tokens, its tile holding the new tokens x the group's query heads,
  so each K/V tile is read once per group, not once per query head).

Tile sizes, warps and pipeline depths come from kernel_table.py (per head dim).
An fp8 pool (`kv_scales` given) is read as fp8 and multiplied by its per-tensor
scales in the kernel, before the dots.

`window` > 0 is sliding-window attention (Mistral): a query at position p sees keys
p - window < k <= p, as transformers defines it.

Only the plain `tl` subset is used, so the same code runs under TRITON_INTERPRET=1
on CPU tensors (the tests) and on the GPU machine's triton 3.6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.engine.runtime.attention.kernel_table import INTERPRETER, Blocks, blocks_for
from worker.engine.runtime.attention.triton_compat import interpreting, patch_interpreter

patch_interpreter()  # triton < 3.7 under TRITON_INTERPRET=1 (see triton_compat.py)


@triton.jit
def _decode_split_kernel(
    Q, K, V, TABLE, IDX, ROWS, SEQ_LENS, Q_LOC, O_PART, LSE_PART,
    sm_scale, window, min_split_len, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tab,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DEQUANT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    item = tl.load(IDX + b)
    row = tl.load(ROWS + item).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + item)
    q_row = tl.load(Q_LOC + item).to(tl.int64)
    # (tl.where, not an `if`: both sides must have one type when compiled for a GPU.)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # This sequence's own piece count: one per min_split_len keys, at most the grid's
    # NUM_SPLITS; the pieces past it are empty (their programs exit at once). Pieces
    # are whole tiles so only the last tile of a sequence is partial.
    n_ctx = seq_len - lo
    splits = tl.minimum(tl.maximum(tl.cdiv(n_ctx, min_split_len), 1), NUM_SPLITS)
    split_len = tl.cdiv(tl.cdiv(n_ctx, splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # num_stages at the launch pipelines this loop: the table and K/V loads of the
    # next tiles are in flight while this one is reduced.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(TABLE + row * stride_tab + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DEQUANT:  # fp8 pool: per-tensor scale, back to q's dtype for the dot
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DEQUANT:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    # An empty split (short sequence) leaves l_i = 0: it gets lse = -inf, weight 0.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        O_PART + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        o,
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, IDX, Q_LOC, OUT,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outt, stride_outh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    item = tl.load(IDX + b)
    q_row = tl.load(Q_LOC + item).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))  # fmt: skip
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    o = tl.load(
        O_PART + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + q_row * stride_outt + h * stride_outh + offs_d,
             out.to(OUT.dtype.element_ty), mask=mask_d)  # fmt: skip


@triton.jit
def _extend_kernel(
    Q, K, V, OUT, TABLE, IDX, ROWS, PREFIX_LENS, Q_LENS, Q_LOC,
    sm_scale, window, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tab,
    stride_outt, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DEQUANT: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    item = tl.load(IDX + i)
    row = tl.load(ROWS + item).to(tl.int64)
    prefix_len = tl.load(PREFIX_LENS + item)
    q_len = tl.load(Q_LENS + item)
    q_loc = tl.load(Q_LOC + item).to(tl.int64)

    # The tile's rows are (new token, query head of this KV head's group) pairs: the
    # group's heads share every K/V tile, loaded once for all of them.
    offs_r = tl.arange(0, BLOCK_M * BLOCK_H)
    tok = mb * BLOCK_M + offs_r // BLOCK_H
    head = kvh * GROUP + offs_r % BLOCK_H
    mask_r = (tok < q_len) & (offs_r % BLOCK_H < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_loc + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = prefix_len + tok
    # Keys up to the last query row of this block (0 keys when the block is past q_len).
    hi = tl.minimum(prefix_len + q_len, prefix_len + (mb + 1) * BLOCK_M)
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)
    lo = tl.maximum(prefix_len + mb * BLOCK_M - window + 1, 0)
    lo = tl.where(window > 0, (lo // BLOCK_N) * BLOCK_N, 0)
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(TABLE + row * stride_tab + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DEQUANT:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
        seen = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        seen = seen & ((offs_n[None, :] > q_pos[:, None] - window) | (window == 0))
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no visible key in this tile yet keeps m = -inf: avoid -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DEQUANT:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        OUT + (q_loc + tok)[:, None] * stride_outt + head[:, None] * stride_outh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )


def _precision(q: torch.Tensor) -> str:
    # fp32 runs are the exactness reference (greedy equality with transformers): no
    # TF32 rounding there. bf16/fp16 inputs ignore the setting.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _blocks(q: torch.Tensor) -> Blocks:
    if interpreting():
        return INTERPRETER
    return blocks_for(q.shape[2], q.element_size())


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    idx: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_loc: torch.Tensor,
    *,
    num_splits: int,
    sm_scale: float,
    window: int = 0,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    min_split_len: int | None = None,
    kv_scales: tuple[float, float] | None = None,
) -> None:
    """out[q_loc[i]] = attention of that one query over its sequence, for i in idx.

    q/out [T, heads, dim]; k_buf/v_buf [slots, kv_heads, dim]; the rest int32 [B].
    `num_splits` is the launch's most pieces per sequence (the grid: a function of the
    batch only, so a CUDA graph holds for any lengths); each sequence uses
    min(num_splits, cdiv(its context, min_split_len)) of them. `partials` (o [B,
    heads, splits, dim], lse [B, heads, splits], fp32) may be passed in so a CUDA
    graph reuses the same buffers. `kv_scales` (k, v): the pool stores fp8 values
    divided by these per-tensor scales; the kernel multiplies them back.
    """
    b = idx.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    blocks = _blocks(q)
    if partials is None:
        o_part = torch.empty(b, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        o_part, lse = partials
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q, k_buf, v_buf, table, idx, rows, seq_lens, q_loc, o_part, lse,
        sm_scale, window, min_split_len or blocks.min_split_len, k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, NUM_SPLITS=num_splits, HEAD_DIM=dim,
        BLOCK_D=_pow2(dim), BLOCK_H=_pow2(group), BLOCK_N=blocks.decode_block_n,
        PRECISION=_precision(q), DEQUANT=kv_scales is not None,
        num_warps=blocks.decode_warps, num_stages=blocks.decode_stages,
    )  # fmt: skip
    _decode_merge_kernel[(b, heads)](
        o_part, lse, idx, q_loc, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=dim, BLOCK_S=_pow2(num_splits, 2), BLOCK_D=_pow2(dim),
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    idx: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_loc: torch.Tensor,
    *,
    max_q_len: int,
    sm_scale: float,
    window: int = 0,
    kv_scales: tuple[float, float] | None = None,
) -> None:
    """Causal attention of each item's new tokens over its prefix + themselves, for i in
    idx: one program per (item, KV head, block of new tokens) covering all the query
    heads of that KV head's group."""
    n = idx.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    blocks = _blocks(q)
    block_h = triton.next_power_of_2(group)
    # Rows = tokens x heads; short runs (decode-like chunks) take a 16-row tile, the
    # smallest a tl.dot accepts, instead of a mostly masked big one.
    rows_per_tile = blocks.extend_rows if max_q_len * block_h > 16 else 16
    block_m = max(1, rows_per_tile // block_h)
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    grid = (n, kv_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, table, idx, rows, prefix_lens, q_lens, q_loc,
        sm_scale, window, k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_D=_pow2(dim), BLOCK_M=block_m, BLOCK_H=block_h,
        BLOCK_N=blocks.extend_block_n, PRECISION=_precision(q), DEQUANT=kv_scales is not None,
        num_warps=blocks.extend_warps, num_stages=blocks.extend_stages,
    )  # fmt: skip
