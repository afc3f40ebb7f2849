"""Batch metadata on the device: the request->token table and one step's inputs.

The table (SGLang's `req_to_token`) has one row per running sequence:
`table[row, pos]` is the KV slot of token `pos`. It lives on the device and is
updated in place, so a step moves only what changed host->device (which positions of
a row those are: the picture in worker/engine/batch.py):

    per item   positions dirty_from .. start_pos+n-1 of its row
    per token  the new token ids and their positions
    per item   row, start_pos, n, where its tokens start in the flat batch

all packed into ONE int64 array (one copy, from pinned memory, non-blocking on
CUDA). Nothing here grows with a sequence's context: a decode step of B sequences
moves O(B) integers whatever their lengths (tests/worker/engine/test_step_inputs.py
counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One forward's view of the batch, shared by every layer (int32 unless noted)."""

    table: torch.Tensor  # [rows, width] the request->token table (int64 on CPU)
    out_slots: torch.Tensor  # [T] int64: slot of each new token, in batch order
    rows: torch.Tensor  # [B] table row of each item
    prefix_lens: torch.Tensor  # [B] tokens with KV before this step (start_pos)
    q_lens: torch.Tensor  # [B] new tokens
    seq_lens: torch.Tensor  # [B] prefix + new
    q_loc: torch.Tensor  # [B] first new token's index in the flat batch
    decode_idx: torch.Tensor  # items with one new token (the decode kernel's)
    extend_idx: torch.Tensor  # the others (the extend kernel's)
    max_q_len: int
    # [B, 4] int64 on the host: q_loc, q_len, prefix_len, row. For SDPA's one call per
    # sequence; None in a CUDA graph, where only device tensors exist.
    host: np.ndarray | None


class AttentionBackend(Protocol):
    """The seam every backend fills (worker/engine/runtime/attention/__init__.py)."""

    name: str

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


class KVStore(Protocol):
    """What attention needs from the KV pool (worker/engine/runtime/kv_pool.py)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def scales(self, layer: int) -> tuple[float, float] | None: ...


@dataclass(frozen=True)
class ForwardContext:
    """Built once per forward by the runner and shared by every layer."""

    kv: KVStore
    backend: AttentionBackend
    meta: AttentionMetadata


class ReqToTokenTable:
    """Rows of the device table handed to sequences by id; the last row is padding
    (CUDA-graph batches point their dummy entries at it)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.device = device
        # int32 on the GPU (half the memory; the kernels widen on load). int64 on CPU,
        # where SDPA's index_select of a row measured ~4% of a decode step slower with
        # an int32 index (bench preset, batch 8).
        self.dtype = torch.int64 if device.type == "cpu" else torch.int32
        self.table = torch.zeros(rows + 1, width, dtype=self.dtype, device=device)
        self._free = list(range(rows - 1, -1, -1))
        self._row_of: dict[Any, int] = {}
        self._known: dict[Any, int] = {}  # positions of the row the runner has written
        self.generation = 0  # bumped when the table is reallocated (graphs re-capture)

    @property
    def pad_row(self) -> int:
        return self.table.shape[0] - 1

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_for(self, key: Any, dirty_from: int) -> int:
        row = self._row_of.get(key)
        if row is None:
            if dirty_from != 0:
                raise ValueError(f"sequence {key!r} is new to the runner; dirty_from must be 0")
            if not self._free:
                self._grow()
            row = self._row_of[key] = self._free.pop()
            self._known[key] = 0
        elif dirty_from > self._known[key]:
            raise ValueError(
                f"sequence {key!r}: dirty_from {dirty_from} is past the {self._known[key]} "
                "positions the runner has seen"
            )
        return row

    def written(self, key: Any, end: int) -> None:
        self._known[key] = end

    def release(self, key: Any) -> None:
        row = self._row_of.pop(key, None)
        if row is not None:
            del self._known[key]
            self._free.append(row)

    def _grow(self) -> None:
        old = self.table
        rows = old.shape[0] - 1
        self.table = torch.zeros(2 * rows + 1, self.width, dtype=self.dtype, device=self.device)
        self.table[:rows] = old[:rows]
        self._free = list(range(2 * rows - 1, rows - 1, -1))
        self.generation += 1


class Staging:
    """Host->device copies of numpy arrays that never make the host wait: on CUDA each
    array goes through a pinned buffer and an asynchronous copy; on CPU the array is
    used as it is.

    The pinned buffer comes from torch's caching host allocator, which records an
    event on every asynchronous copy out of a block and hands that block out again
    only once the copy is done; so a fresh buffer per upload is safe even when a step
    uploads several arrays, and costs no allocation after the first steps. (A single
    reused buffer would have to wait for the previous copy before each upload: one
    host synchronisation more for every upload after the first in a step.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 rows of the flat batch whose logits are returned
    host_elements: int  # int64 values moved host->device this step


def build_step(
    batch: list[Any],
    keys: list[Any],
    table: ReqToTokenTable,
    staging: Staging,
    *,
    pad_to: int | None = None,
    pad_slot: int = 0,
) -> StepInputs:
    """Pack the batch's ids, positions, table updates and per-item metadata; one copy.

    Each item needs `input_ids`, `start_pos`, `slots`, `dirty_from` and `sample`;
    `keys[i]` owns item i's table row. Only `slots[dirty_from:]` is read.

    `pad_to` (a decode-only batch for a CUDA graph of that size): dummy decode items
    fill the batch up to `pad_to`, each one token at position 0 whose K/V goes to
    `pad_slot`, attending to one key in the table's padding row. Their outputs exist
    but are never sampled.
    """
    b = len(batch)
    q_lens = np.fromiter((len(it.input_ids) for it in batch), dtype=np.int64, count=b)
    starts = np.fromiter((it.start_pos for it in batch), dtype=np.int64, count=b)
    dirty = np.fromiter((it.dirty_from for it in batch), dtype=np.int64, count=b)
    rows = np.fromiter(
        (table.row_for(k, it.dirty_from) for k, it in zip(keys, batch, strict=True)), np.int64, b
    )
    ends = starts + q_lens
    q_loc = np.cumsum(q_lens) - q_lens
    t = int(q_lens.sum())
    upd_vals = np.concatenate([np.asarray(it.slots[it.dirty_from :], np.int64) for it in batch])
    # Flat table index of every updated position: row * width + pos.
    spans = ends - dirty
    upd_idx = np.repeat(rows * table.width, spans) + _ranges(dirty, spans)
    positions = np.repeat(starts - q_loc, q_lens) + np.arange(t)
    new_slot_idx = np.repeat(np.cumsum(spans) - q_lens - q_loc, q_lens) + np.arange(t)
    sample = np.fromiter((bool(it.sample) for it in batch), dtype=bool, count=b)
    ids = np.concatenate([np.asarray(it.input_ids, np.int64) for it in batch])
    sample_rows = (q_loc + q_lens - 1)[sample]
    out_slots = upd_vals[new_slot_idx]
    items = [rows, starts, q_lens, ends, q_loc]
    if pad_to is not None:
        if t != b or pad_to < b:
            raise ValueError(f"only a decode batch of <= {pad_to} items pads, got {b} items")
        extra = pad_to - b
        ids, positions = _pad(ids, extra, 0), _pad(positions, extra, 0)
        out_slots = _pad(out_slots, extra, pad_slot)
        items = [_pad(rows, extra, table.pad_row), _pad(starts, extra, 0), _pad(q_lens, extra, 1),
                 _pad(ends, extra, 1), np.arange(pad_to)]  # fmt: skip
        b = t = pad_to
        q_lens = items[2]
    decode = q_lens == 1
    packed = np.concatenate([
        ids, positions, out_slots, upd_vals, upd_idx, *items,
        np.flatnonzero(decode), np.flatnonzero(~decode), sample_rows,
    ])  # fmt: skip
    dev = staging.upload(packed)
    u = len(upd_vals)
    ids, pos, out_slots = dev[: 3 * t].view(3, t)
    table.table.view(-1)[dev[3 * t + u : 3 * t + 2 * u]] = dev[3 * t : 3 * t + u].to(table.dtype)
    off = 3 * t + 2 * u
    per_item = dev[off : off + 5 * b].to(torch.int32).view(5, b)
    off += 5 * b
    n_dec = int(decode.sum())
    idx = dev[off : off + b].to(torch.int32)
    for key, end in zip(keys, ends.tolist(), strict=True):
        table.written(key, end)
    meta = AttentionMetadata(
        table=table.table,
        out_slots=out_slots,
        rows=per_item[0],
        prefix_lens=per_item[1],
        q_lens=per_item[2],
        seq_lens=per_item[3],
        q_loc=per_item[4],
        decode_idx=idx[:n_dec],
        extend_idx=idx[n_dec:],
        max_q_len=int(q_lens.max()),
        host=np.stack([items[4], items[2], items[1], items[0]], axis=1),
    )
    return StepInputs(ids, pos, meta, dev[off + b :], host_elements=packed.size)


def _pad(a: np.ndarray, extra: int, value: int) -> np.ndarray:
    return np.concatenate([a, np.full(extra, value, dtype=np.int64)])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised."""
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total) - offsets
