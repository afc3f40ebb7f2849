"""CUDA graphs for decode-only steps, one per batch-size bucket.

A decode step of a small model is mostly kernel-launch overhead (a few hundred
launches of microseconds each); replaying a captured graph launches them all at once.
A graph fixes every tensor's address and shape, so each bucket has static input
buffers, the batch is padded up to the bucket (`build_step(pad_to=...)`: dummy items
write their K/V to the pool's pad slot and read the table's pad row), and the
attention kernels' grids depend on the bucket only (flash-decoding's split count is
a function of the batch size; each sequence's split length is computed on the
device). Batches larger than the largest bucket, and any step with a prefill chunk,
run eagerly, or as piecewise graphs when those are on (piecewise_graphs.py).

Every bucket up to the running-request limit is compiled and captured at start-up
(`capture_all`, which the runner calls before the worker reports ready), never inside
a live step: a Triton compile, warm-ups and a capture cost seconds, and an op that
cannot be captured must fail before traffic, not in front of a user. A bucket that is
somehow missing is still captured when first used, and counted (`late_captures`).
If the request->token table is reallocated the graphs are dropped and captured again.

`emulate=True` (CPU tests) keeps the whole life cycle — static buffers, padding,
capture at start, load and replay — but "replays" by running the model eagerly on
the static buffers, so the bookkeeping is tested where no GPU is.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from worker.engine.runtime.attention.metadata import (
    AttentionMetadata,
    ForwardContext,
    ReqToTokenTable,
    StepInputs,
)

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_for(batch: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds `batch` items, None when none does."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


class _Graph:
    def __init__(self, bucket: int, device: torch.device, emulate: bool = False) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(bucket, **i64)
        self.positions = torch.zeros(bucket, **i64)
        self.out_slots = torch.zeros(bucket, **i64)
        self.items = torch.ones(5, bucket, **i32)  # rows, starts, q_lens, seq_lens, q_loc
        self.items[1].zero_()
        self.items[4].copy_(torch.arange(bucket, **i32))
        self.decode_idx = torch.arange(bucket, **i32)
        self.graph = None if emulate else torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None

    def meta(self, table: torch.Tensor, host: np.ndarray | None = None) -> AttentionMetadata:
        rows, starts, q_lens, seq_lens, q_loc = self.items.unbind(0)
        return AttentionMetadata(
            table=table, out_slots=self.out_slots, rows=rows, prefix_lens=starts,
            q_lens=q_lens, seq_lens=seq_lens, q_loc=q_loc, decode_idx=self.decode_idx,
            extend_idx=self.decode_idx[:0], max_q_len=1, host=host,
        )  # fmt: skip

    def load(self, inputs: StepInputs) -> None:
        m = inputs.meta
        self.input_ids.copy_(inputs.input_ids, non_blocking=True)
        self.positions.copy_(inputs.positions, non_blocking=True)
        self.out_slots.copy_(m.out_slots, non_blocking=True)
        self.items.copy_(torch.stack([m.rows, m.prefix_lens, m.q_lens, m.seq_lens, m.q_loc]))


class DecodeGraphs:
    def __init__(
        self,
        model: Any,
        pool: Any,
        backend: Any,
        table: ReqToTokenTable,
        buckets: tuple[int, ...] = BUCKETS,
        emulate: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.table = table
        self.buckets = buckets
        self.emulate = emulate
        self._graphs: dict[int, _Graph] = {}
        self._generation = table.generation
        self._mempool: Any = None
        self.replays = 0
        self.captures = 0
        self.late_captures = 0  # captured inside a live step: none after capture_all
        self.capture_seconds: dict[int, float] = {}  # bucket -> its start-up capture

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.buckets)

    def capture_all(self, max_batch: int) -> float:
        """Compile and capture every bucket a batch of up to `max_batch` uses; the
        seconds it took (each bucket's in `capture_seconds`)."""
        largest = self.bucket_for(max_batch) or self.buckets[-1]
        start = time.perf_counter()
        for bucket in (b for b in self.buckets if b <= largest):
            t = time.perf_counter()
            self._graphs[bucket] = self._capture(bucket)
            self.capture_seconds[bucket] = time.perf_counter() - t
        total = time.perf_counter() - start
        kind = "emulated graphs" if self.emulate else "CUDA graphs"
        log.info(
            "captured %d decode %s (batch buckets %d..%d) in %.2f s before serving",
            len(self.capture_seconds), kind, self.buckets[0], largest, total,
        )  # fmt: skip
        return total

    def run(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """Final hidden states [bucket, hidden] of the padded decode batch."""
        if self.table.generation != self._generation:
            self._graphs.clear()
            self._generation = self.table.generation
        g = self._graphs.get(bucket)
        if g is None:
            log.warning("decode graph for batch bucket %d captured during traffic", bucket)
            self.late_captures += 1
            g = self._graphs[bucket] = self._capture(bucket)
        g.load(inputs)
        if g.graph is None:  # emulated: the same static buffers, run eagerly
            g.hidden = self.model(g.input_ids, g.positions, self._context(g, inputs.meta.host))
        else:
            g.graph.replay()
        self.replays += 1
        assert g.hidden is not None
        return g.hidden

    def _context(self, g: _Graph, host: np.ndarray | None) -> ForwardContext:
        return ForwardContext(
            kv=self.pool, backend=self.backend, meta=g.meta(self.table.table, host)
        )

    def _capture(self, bucket: int) -> _Graph:
        device = self.table.device
        g = _Graph(bucket, device, emulate=self.emulate)
        g.items[0].fill_(self.table.pad_row)
        g.out_slots.fill_(self.pool.pad_slot)
        self.captures += 1
        if self.emulate:  # a warm-up on the padding, as the real capture does
            pad = np.stack([np.arange(bucket), np.ones(bucket, np.int64),
                            np.zeros(bucket, np.int64), np.full(bucket, self.table.pad_row)], 1)  # fmt: skip
            g.hidden = self.model(g.input_ids, g.positions, self._context(g, pad))
            return g
        ctx = self._context(g, None)
        # Warm up on a side stream (triton compiles, cuBLAS picks kernels), then capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(g.input_ids, g.positions, ctx)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g.graph, pool=self._mempool):
            g.hidden = self.model(g.input_ids, g.positions, ctx)
        return g
