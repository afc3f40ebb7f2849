"""The model runner: owns the model, the KV pool, the attention backend and every
device tensor, including the request->token table and the logits.

The scheduler hands it a batch of `BatchItem`s (pure Python: ids, a start
position and a numpy slot list) and gets back one row of fp32 logits per item that
samples. How one item's slots line up with its tokens and its table row: the picture
in worker/engine/batch.py.

A decode step is an item with n = 1; a prefill chunk has start_pos = the tokens
already cached or prefilled. The table row of a sequence lives on the device while
it runs (`seq_id` names it; `release(seq_id)` frees it), so a step reads only
`slots[dirty_from:]` and moves only that host->device: per-step host work does not
grow with context. Only new tokens count in `tokens_computed`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from worker.engine.batch import BatchItem
from worker.engine.config import debug_from_env
from worker.engine.model_config import ModelConfig
from worker.engine.runtime.attention import make_backend, resolve_backend
from worker.engine.runtime.attention.metadata import (
    ForwardContext,
    ReqToTokenTable,
    Staging,
    StepInputs,
    build_step,
)
from worker.engine.runtime.cuda_graphs import DecodeGraphs
from worker.engine.runtime.device import pick_device, pick_dtype
from worker.engine.runtime.fused_ops import TORCH_OPS, Ops
from worker.engine.runtime.futures import FutureTokens
from worker.engine.runtime.host_pool import HostKVPool
from worker.engine.runtime.kv_pool import KV_CACHE_DTYPES, KVPool
from worker.engine.runtime.piecewise_graphs import PiecewiseGraphs
from worker.engine.runtime.weights import load_model
from worker.engine.types import KVCopies

# Cap on an automatically sized pool on CPU (64 MB for the tiny model, 1 GB for the
# bench preset); pass kv_capacity_tokens to go beyond it.
CPU_DEFAULT_KV_TOKENS = 131_072


__all__ = ["CPU_DEFAULT_KV_TOKENS", "BatchItem", "ModelRunner"]


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        kv_capacity_tokens: int | None = None,
        kv_memory_fraction: float = 0.5,
        host_cache_tokens: int = 0,
        attention_backend: str = "auto",
        cuda_graphs: bool = True,
        piecewise_max_tokens: int = 0,
        max_running_requests: int = 64,
        kv_cache_dtype: str = "auto",
        debug_checks: bool | None = None,
        emulate_cuda_graphs: bool = False,  # CPU tests: the graphs' life cycle, run eagerly
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = cfg = ModelConfig.from_dir(self.model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, cfg.torch_dtype, self.device)
        self.attention_backend = resolve_backend(attention_backend, self.device)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
            )
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        self.model = load_model(self.model_dir, cfg, self.device, self.dtype)
        self.model.ops = ops_for(self.attention_backend)
        # The pool is sized after the weights are on the device, so "free memory" is
        # what is really left for KV.
        capacity = kv_capacity_tokens
        if capacity is None:
            capacity = KVPool.capacity_for_memory(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                self.kv_dtype, self.device, kv_memory_fraction,
            )  # fmt: skip
            if self.device.type == "cpu":
                # Host RAM is shared with everything else on the machine, and the pool is
                # zero-filled up front: half of it would be tens of GB touched at start.
                capacity = min(capacity, CPU_DEFAULT_KV_TOKENS)
        if capacity <= 0:
            raise ValueError(f"KV pool capacity must be positive, got {capacity} tokens")
        self.pool = KVPool(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
            capacity, self.dtype, self.device, kv_dtype=self.kv_dtype,
        )  # fmt: skip
        # The host tier's pool (None: off); refused here when host memory cannot hold it.
        self.host_pool = HostKVPool(self.pool, host_cache_tokens) if host_cache_tokens else None
        self.backend = make_backend(
            self.attention_backend, self.pool.k, self.pool.v,
            num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
            sliding_window=cfg.sliding_window, device=self.device,
            kv_scales=self.pool.all_scales(),
        )  # fmt: skip
        # A sequence never has more tokens than the pool has slots.
        width = min(cfg.max_position_embeddings, capacity)
        self.table = ReqToTokenTable(max_running_requests, width, self.device)
        self.staging = Staging(self.device)
        self.graphs: DecodeGraphs | None = None
        if emulate_cuda_graphs or (
            cuda_graphs and self.device.type == "cuda" and self.attention_backend == "triton"
        ):
            self.graphs = DecodeGraphs(
                self.model, self.pool, self.backend, self.table, emulate=emulate_cuda_graphs
            )
        # Steps with a prefill chunk of up to `piecewise_max_tokens` tokens (0: off):
        # graphs between the attention calls (piecewise_graphs.py), under the same rule.
        self.piecewise: PiecewiseGraphs | None = None
        if self.graphs is not None and piecewise_max_tokens > 0:
            self.piecewise = PiecewiseGraphs(
                self.model, self.pool, self.backend, self.table, piecewise_max_tokens,
                emulate=emulate_cuda_graphs,
            )  # fmt: skip
        # Per-step batch validation: tests and RADIX_ENGINE_DEBUG=1 (config.py says why).
        self.debug_checks = debug_from_env() if debug_checks is None else debug_checks
        # Step N's draws, read by step N+1 on the device (overlap scheduling).
        self.futures = FutureTokens(max_running_requests, self.device)
        self.overlap_inputs = False  # set by the engine when it schedules with overlap
        self.tokens_computed = 0
        self.host_elements_last_step = 0  # int64 values moved host->device (tests)
        # Every decode bucket and every token bucket captured now, before the worker
        # reports ready.
        self.graph_capture_s = 0.0
        if self.graphs is not None:
            self.graph_capture_s = self.graphs.capture_all(max_running_requests)
        if self.piecewise is not None:
            self.graph_capture_s += self.piecewise.capture_all()

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def capacity(self) -> int:
        """KV slots in the pool: the engine's allocator hands out [0, capacity)."""
        return self.pool.capacity

    @property
    def host_capacity(self) -> int:
        """Host tier slots (0: no host tier): the engine sizes the radix cache's from it."""
        return 0 if self.host_pool is None else self.host_pool.capacity

    @property
    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(
            self.pool.num_layers, self.pool.num_kv_heads, self.pool.head_dim, self.pool.dtype
        )

    @property
    def host_load_bytes_per_s(self) -> float:
        return 0.0 if self.host_pool is None else self.host_pool.load_bytes_per_s

    def copy_kv(self, copies: KVCopies) -> None:
        """The step's planned write-backs and loads (host_pool.py: no host sync on CUDA)."""
        assert self.host_pool is not None, "copies planned without a host pool"
        self.host_pool.copy(copies)

    def release(self, seq_id: int) -> None:
        """The sequence left the running set: its table row is free (no-op if unknown)."""
        self.table.release(seq_id)

    def _check(self, batch: list[BatchItem]) -> None:
        """Bad items are caller bugs, but a clear error beats a CUDA index assert.
        Reads only what the step moves (new ids, slots[dirty_from:]); debug mode only."""
        for i, item in enumerate(batch):
            n = len(item.input_ids)
            if n == 0:
                raise ValueError(f"item {i}: no input_ids to run")
            if item.start_pos < 0:
                raise ValueError(f"item {i}: start_pos {item.start_pos} < 0")
            if not 0 <= item.dirty_from <= item.start_pos:
                raise ValueError(f"item {i}: dirty_from {item.dirty_from} not in [0, start_pos]")
            if len(item.slots) != item.start_pos + n:
                raise ValueError(
                    f"item {i}: {len(item.slots)} slots for start_pos {item.start_pos} "
                    f"+ {n} new tokens"
                )
            if item.start_pos + n > min(self.max_model_len, self.table.width):
                raise ValueError(
                    f"item {i}: {item.start_pos + n} tokens exceed max_model_len {self.max_model_len}"
                )
            ids = np.asarray(item.input_ids)
            low = -self.futures.size if self.overlap_inputs else 0  # placeholders
            if ids.min() < low or ids.max() >= self.config.vocab_size:
                raise ValueError(f"item {i}: token ids must be in [0, {self.config.vocab_size})")
            slots = np.asarray(item.slots[item.dirty_from :])
            if slots.min() < 0 or slots.max() >= self.pool.capacity:
                raise ValueError(f"item {i}: slots must be in [0, {self.pool.capacity})")

    @torch.inference_mode()
    def forward(self, batch: list[BatchItem]) -> torch.Tensor:
        """fp32 logits [items with sample, vocab] of each such item's last input token,
        in batch order; writes the K/V of every new token into its slot."""
        if not batch:
            raise ValueError("forward() needs at least one item")
        if self.debug_checks:
            self._check(batch)
        keys = [("step", i) if it.seq_id is None else it.seq_id for i, it in enumerate(batch)]
        decode_only = all(len(it.input_ids) == 1 for it in batch)
        bucket = self.graphs.bucket_for(len(batch)) if self.graphs and decode_only else None
        tokens = sum(len(it.input_ids) for it in batch)
        piece_bucket = None
        if bucket is None and self.piecewise is not None:
            piece_bucket = self.piecewise.bucket_for(tokens)
        try:
            inputs = build_step(
                batch, keys, self.table, self.staging, pad_to=bucket, pad_slot=self.pool.pad_slot
            )
        finally:
            for key in keys:
                if isinstance(key, tuple):
                    self.table.release(key)
        self.host_elements_last_step = inputs.host_elements
        if self.overlap_inputs:
            # Placeholders of the previous step's draws: swapped on the device (futures.py).
            inputs = replace(inputs, input_ids=self.futures.resolve(inputs.input_ids))
        if bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(inputs, bucket)
        elif piece_bucket is not None:
            assert self.piecewise is not None
            hidden = self.piecewise.run(inputs, piece_bucket)
        else:
            hidden = self.run_eager(inputs)
        self.tokens_computed += tokens
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def run_eager(self, inputs: StepInputs) -> torch.Tensor:
        ctx = ForwardContext(kv=self.pool, backend=self.backend, meta=inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, ctx)


def ops_for(attention_backend: str) -> Ops:
    """The fused kernels go with the triton attention backend (CUDA, or the CPU
    interpreter); the sdpa backend keeps the eager reference ops."""
    if attention_backend != "triton":
        return TORCH_OPS
    from worker.engine.runtime.fused_kernels import TritonOps

    return TritonOps()
