"""Piecewise CUDA graphs for steps with a prefill chunk (mixed and extend steps).

A decode-only step is one graph per batch bucket (cuda_graphs.py). A step with a
prefill chunk cannot be: attention's varlen metadata (each item's q_len, prefix,
the extend kernel's grid from the longest chunk) changes every step. Everything else
in the forward only sees a flat run of T tokens, row by row. So, as vLLM's piecewise
graphs and SGLang's piecewise runner do, the forward is cut at attention, per padded
token-count bucket:

    piece 0      embedding, RoPE tables, layer 0's input norm, qkv, RoPE + KV store
    piece i      layer i-1's o_proj, norm, MLP; layer i's input norm, qkv, RoPE + KV store
    piece L      the last layer's o_proj, norm, MLP, the final residual add

each captured as its own graph, with attention run eagerly between them on the real
tokens only. The logits (lm_head on the sampled rows) stay eager in the runner.

Static buffers, sized for the largest bucket, carry everything across a cut (token
ids, positions, KV slots, the RoPE tables, q/k/v, the residual, attention's output,
the final hidden states); a bucket of T tokens uses their first T rows, so every
bucket and every layer reads and writes the same addresses. The step's tokens fill
rows [0, t); rows [t, T) are padding: token 0 at position 0, its K/V written to the
pool's pad slot (as decode padding does), its rows never given to attention and
never sampled. Rows never mix outside attention, so the padding cannot touch the real
rows. All pieces of all buckets share one graph memory pool, captured largest first,
so the smaller buckets reuse its blocks; the buffers above live outside the pool.

What was checked so nothing captured depends on per-step host values: the pieces
read no `AttentionMetadata` (DecoderLayer.pre_attention / post_attention take only
tensors: the static slots, not `meta.out_slots`); every shape inside a piece is the
bucket's; the layer index and the fp8 KV scales are Python constants baked into the
capture (the scales are set before start-up and never after); the triton fused ops'
grids are (T,) or (T, n / BLOCK), fixed per bucket; `kv.write` is an index_copy_ on
device slots. Attention runs outside the graphs on the same stream, so its kernels
(with a grid from `max_q_len`) are ordered with the replays. Start-up also runs one
whole step per bucket (one dummy extend item over the padding row) so the extend
kernel is compiled before traffic. What only a GPU run can confirm: that capture
succeeds for every piece (no hidden host sync in cuBLAS or triton launch paths), that
replays match eager to rounding, and that no Triton kernel compiles during traffic
for `max_q_len` values the warm-up did not use (the kernel table's choices).

`emulate=True` (CPU tests) keeps the whole life cycle — static buffers, padding,
capture at start, load and replay — but "replays" a piece by running it eagerly on
the static buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.engine.runtime.attention.metadata import AttentionMetadata, ReqToTokenTable, StepInputs

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                 6144, 8192)  # fmt: skip


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The buckets up to `max_tokens`, which is always the last one."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    return (*(b for b in TOKEN_BUCKETS if b < max_tokens), max_tokens)


class _Buffers:
    """The static tensors every piece reads and writes (module docstring)."""

    def __init__(self, model: Any, rows: int, pad_slot: int, device: torch.device) -> None:
        cfg = model.config
        dtype = model.model.embed_tokens.weight.dtype
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        act = dict(dtype=dtype, device=device)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_slots = torch.full((rows,), pad_slot, dtype=torch.int64, device=device)
        self.cos = torch.zeros(rows, 1, dim // 2, **act)
        self.sin = torch.zeros(rows, 1, dim // 2, **act)
        self.q = torch.zeros(rows, heads, dim, **act)
        self.k = torch.zeros(rows, kv_heads, dim, **act)
        self.v = torch.zeros(rows, kv_heads, dim, **act)
        self.residual = torch.zeros(rows, cfg.hidden_size, **act)
        self.attn = torch.zeros(rows, heads, dim, **act)  # zeros: padding rows stay finite
        self.hidden = torch.zeros(rows, cfg.hidden_size, **act)


class _Bucket:
    def __init__(self, pieces: list[Callable[[], None]], emulate: bool) -> None:
        self.pieces = pieces
        self.graphs = None if emulate else [torch.cuda.CUDAGraph() for _ in pieces]

    def replay(self, i: int) -> None:
        if self.graphs is None:  # emulated: the same static buffers, run eagerly
            self.pieces[i]()
        else:
            self.graphs[i].replay()


class PiecewiseGraphs:
    def __init__(
        self,
        model: Any,
        pool: Any,
        backend: Any,
        table: ReqToTokenTable,
        max_tokens: int,
        emulate: bool = False,
        buckets: tuple[int, ...] | None = None,  # default: token_buckets(max_tokens)
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.table = table
        self.buckets = tuple(sorted(buckets)) if buckets else token_buckets(max_tokens)
        self.emulate = emulate
        self.num_layers = len(model.model.layers)
        self.buf = _Buffers(model, self.buckets[-1], pool.pad_slot, table.device)
        self._buckets: dict[int, _Bucket] = {}
        self._mempool: Any = None
        self.replays = 0
        self.captures = 0
        self.late_captures = 0  # captured inside a live step: none after capture_all
        self.capture_seconds: dict[int, float] = {}  # bucket -> its start-up capture

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket that holds `tokens`, None when none does."""
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its pool
        blocks), then run one whole step through each; the seconds it took."""
        start = time.perf_counter()
        for bucket in sorted(self.buckets, reverse=True):
            t = time.perf_counter()
            self._buckets[bucket] = self._capture(bucket)
            self._warm_step(bucket)
            self.capture_seconds[bucket] = time.perf_counter() - t
        total = time.perf_counter() - start
        kind = "emulated graphs" if self.emulate else "CUDA graphs"
        log.info(
            "captured %d piecewise %s (token buckets %d..%d, %d pieces each) in %.2f s "
            "before serving", len(self.buckets), kind, self.buckets[0], self.buckets[-1],
            self.num_layers + 1, total,
        )  # fmt: skip
        return total

    def run(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """Final hidden states [bucket, hidden]; rows past the step's tokens are padding."""
        g = self._buckets.get(bucket)
        if g is None:
            log.warning("piecewise graphs for token bucket %d captured during traffic", bucket)
            self.late_captures += 1
            g = self._buckets[bucket] = self._capture(bucket)
        t = inputs.input_ids.shape[0]
        b = self.buf
        b.input_ids[:t].copy_(inputs.input_ids, non_blocking=True)
        b.positions[:t].copy_(inputs.positions, non_blocking=True)
        b.out_slots[:t].copy_(inputs.meta.out_slots, non_blocking=True)
        b.input_ids[t:bucket].zero_()
        b.positions[t:bucket].zero_()
        b.out_slots[t:bucket].fill_(self.pool.pad_slot)  # padding K/V: the pad slot
        self._replay(g, t, inputs.meta)
        self.replays += 1
        return b.hidden[:bucket]

    def _replay(self, g: _Bucket, t: int, meta: AttentionMetadata) -> None:
        b = self.buf
        g.replay(0)
        for layer in range(self.num_layers):
            # Eager: the real tokens only, with this step's metadata.
            out = self.backend.attend(layer, b.q[:t], b.k[:t], b.v[:t], meta)
            b.attn[:t].copy_(out)
            g.replay(layer + 1)

    def _pieces(self, t: int) -> list[Callable[[], None]]:
        m, b, ops, pool = self.model, self.buf, self.model.ops, self.pool
        layers = m.model.layers
        cos, sin, slots = b.cos[:t], b.sin[:t], b.out_slots[:t]

        def keep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, res: torch.Tensor) -> None:
            b.q[:t].copy_(q)
            b.k[:t].copy_(k)
            b.v[:t].copy_(v)
            b.residual[:t].copy_(res)

        def head() -> None:
            x = m.model.embed_tokens(b.input_ids[:t])
            c, s = m.rope_tables(b.positions[:t], x.dtype)
            cos.copy_(c)
            sin.copy_(s)
            keep(*layers[0].pre_attention(x, None, cos, sin, pool, slots, ops))

        def middle(i: int) -> Callable[[], None]:
            def piece() -> None:
                x, res = layers[i - 1].post_attention(b.attn[:t], b.residual[:t], ops)
                keep(*layers[i].pre_attention(x, res, cos, sin, pool, slots, ops))

            return piece

        def tail() -> None:
            x, res = layers[-1].post_attention(b.attn[:t], b.residual[:t], ops)
            b.hidden[:t].copy_(x + res)

        return [head, *(middle(i) for i in range(1, self.num_layers)), tail]

    def _capture(self, bucket: int) -> _Bucket:
        b = self.buf
        b.input_ids[:bucket].zero_()
        b.positions[:bucket].zero_()
        b.out_slots[:bucket].fill_(self.pool.pad_slot)  # warm-ups write K/V to the pad slot
        g = _Bucket(self._pieces(bucket), self.emulate)
        self.captures += 1
        if g.graphs is None:
            for piece in g.pieces:  # a warm-up on the padding, as the real capture does
                piece()
            return g
        device = self.table.device
        # Warm up on a side stream (triton compiles, cuBLAS picks kernels), then capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                for piece in g.pieces:
                    piece()
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        for piece, graph in zip(g.pieces, g.graphs, strict=True):
            with torch.cuda.graph(graph, pool=self._mempool):
                piece()
        return g

    def _warm_step(self, bucket: int) -> None:
        """One whole step through the bucket before traffic: a dummy extend item on the
        table's padding row (its keys read slot 0's K/V; the output is dropped), so the
        extend kernel compiles now, and the capture path is the serving path."""
        n = min(bucket, self.table.width)
        dev = self.table.device
        one = torch.ones(1, dtype=torch.int32, device=dev)
        idx = torch.zeros(1, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            table=self.table.table, out_slots=self.buf.out_slots[:n],
            rows=one * self.table.pad_row, prefix_lens=idx * 0, q_lens=one * n,
            seq_lens=one * n, q_loc=idx, decode_idx=idx[:0], extend_idx=idx, max_q_len=n,
            host=np.array([[0, n, 0, self.table.pad_row]], dtype=np.int64),
        )  # fmt: skip
        self.buf.out_slots[:bucket].fill_(self.pool.pad_slot)
        self._replay(self._buckets[bucket], n, meta)
