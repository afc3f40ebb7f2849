"""The triton backend: decode and extend kernels over the request->token table.

A mixed step (decodes + prefill chunks) is one forward: the decode kernel takes the
items with one new token, the extend kernel the rest, each in one launch over its
subset, both writing into the same output.
"""

from __future__ import annotations

import torch

from worker.engine.runtime.attention.metadata import AttentionMetadata
from worker.engine.runtime.attention.triton_kernels import decode_attention, extend_attention

# Flash-decoding aims for about this many programs per decode launch (2 per SM on an
# H200's 132 SMs), splitting each context into up to MAX_SPLITS pieces to get there.
TARGET_PROGRAMS = 256
MAX_SPLITS = 16


def splits_for(batch: int, kv_heads: int) -> int:
    """The most context pieces per sequence for a decode batch (the launch grid): a
    function of the batch size only, so a CUDA graph captured for a batch size stays
    valid for any lengths. Each sequence then uses as many of them as its length
    calls for (triton_kernels.py: one piece per `min_split_len` keys)."""
    want = -(-TARGET_PROGRAMS // max(1, batch * kv_heads))
    splits = 1
    while splits < min(want, MAX_SPLITS):
        splits *= 2
    return splits


class TritonBackend:
    name = "triton"

    def __init__(
        self,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        *,
        num_heads: int,
        head_dim: int,
        window: int = 0,
        device: torch.device,
        num_splits: int | None = None,
        kv_scales: list[tuple[float, float]] | None = None,
    ) -> None:
        self.k = k_buffers
        self.v = v_buffers
        self.sm_scale = head_dim**-0.5
        self.window = window
        self.kv_heads = k_buffers[0].shape[1]
        # Under the CPU interpreter every program costs Python time: fewer pieces.
        self.num_splits = num_splits or (None if device.type == "cuda" else 4)
        self.min_split_len: int | None = None  # None: the kernel table's
        self.kv_scales = kv_scales  # per layer (k, v) for an fp8 pool; None: not quantized

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = q.new_empty(q.shape)  # contiguous (q may be a view of the fused qkv)
        n_decode = meta.decode_idx.shape[0]
        scales = None if self.kv_scales is None else self.kv_scales[layer]
        if n_decode:
            decode_attention(
                q, self.k[layer], self.v[layer], out, meta.table, meta.decode_idx,
                meta.rows, meta.seq_lens, meta.q_loc,
                num_splits=self.num_splits or splits_for(n_decode, self.kv_heads),
                sm_scale=self.sm_scale, window=self.window, min_split_len=self.min_split_len,
                kv_scales=scales,
            )  # fmt: skip
        if meta.extend_idx.shape[0]:
            extend_attention(
                q, self.k[layer], self.v[layer], out, meta.table, meta.extend_idx,
                meta.rows, meta.prefix_lens, meta.q_lens, meta.q_loc,
                max_q_len=meta.max_q_len, sm_scale=self.sm_scale, window=self.window,
                kv_scales=scales,
            )  # fmt: skip
        return out
