"""CUDA graphs for decode-only steps, one per batch-size bucket.

A decode step of a small model is mostly kernel-launch overhead (a few hundred
launches of microseconds each); replaying a captured graph launches them all at once.
A graph fixes every tensor's address and shape, so each bucket has static input
buffers, the batch is padded up to the bucket (`build_step(pad_to=...)`: dummy items
write their K/V to the pool's pad slot and read the table's pad row), and the
attention kernels' grids depend on the bucket only (flash-decoding's split count is
a function of the batch size; each sequence's split length is computed on the
device). Batches larger than the largest bucket, and any step with a prefill chunk,
run eagerly. Graphs are captured lazily, the first time a bucket is used, and dropped
when the request->token table is reallocated.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from worker.engine.runtime.attention.metadata import AttentionMetadata, ReqToTokenTable, StepInputs
from worker.engine.runtime.model import ForwardContext

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_for(batch: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds `batch` items, None when none does."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


class _Graph:
    def __init__(self, bucket: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(bucket, **i64)
        self.positions = torch.zeros(bucket, **i64)
        self.out_slots = torch.zeros(bucket, **i64)
        self.items = torch.ones(5, bucket, **i32)  # rows, starts, q_lens, seq_lens, q_loc
        self.items[1].zero_()
        self.items[4].copy_(torch.arange(bucket, **i32))
        self.decode_idx = torch.arange(bucket, **i32)
        self.graph = torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None

    def meta(self, table: torch.Tensor) -> AttentionMetadata:
        rows, starts, q_lens, seq_lens, q_loc = self.items.unbind(0)
        return AttentionMetadata(
            table=table, out_slots=self.out_slots, rows=rows, prefix_lens=starts,
            q_lens=q_lens, seq_lens=seq_lens, q_loc=q_loc, decode_idx=self.decode_idx,
            extend_idx=self.decode_idx[:0], max_q_len=1, host=None,
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
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.table = table
        self.buckets = buckets
        self._graphs: dict[int, _Graph] = {}
        self._generation = table.generation
        self._mempool: Any = None
        self.replays = 0

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.buckets)

    def run(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """Final hidden states [bucket, hidden] of the padded decode batch."""
        if self.table.generation != self._generation:
            self._graphs.clear()
            self._generation = self.table.generation
        g = self._graphs.get(bucket)
        if g is None:
            g = self._graphs[bucket] = self._capture(bucket)
        g.load(inputs)
        g.graph.replay()
        self.replays += 1
        assert g.hidden is not None
        return g.hidden

    def _capture(self, bucket: int) -> _Graph:
        device = self.table.device
        g = _Graph(bucket, device)
        g.items[0].fill_(self.table.pad_row)
        g.out_slots.fill_(self.pool.pad_slot)
        ctx = ForwardContext(kv=self.pool, backend=self.backend, meta=g.meta(self.table.table))
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
