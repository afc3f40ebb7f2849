"""The model runner: owns the model, the KV pool and every device tensor.

The scheduler hands it a batch of `SeqBatchItem`s (pure Python: ids, a start
position and a numpy slot list) and gets back one row of fp32 logits per item.
How one item's slots line up with its tokens:

    positions  0 ........ start_pos-1 | start_pos ....... start_pos+n-1
    tokens     cached prefix          | input_ids (n NEW tokens, run now)
    slots      slots[:start_pos]      | slots[start_pos:]
               K/V read from the pool | K/V computed now, written to the pool

A decode step is an item with n = 1; a prefill chunk has start_pos = the tokens
already cached or prefilled. Only new tokens count in `tokens_computed`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from worker.engine.batch import SeqBatchItem
from worker.engine.device import pick_device, pick_dtype
from worker.engine.kv_pool import KVPool
from worker.engine.model import DecodeGroup, ForwardContext, SeqSpan, prefix_causal_mask
from worker.engine.model_config import ModelConfig
from worker.engine.weights import load_model

# Cap on an automatically sized pool on CPU (64 MB for the tiny model, 1 GB for the
# bench preset); pass kv_capacity_tokens to go beyond it.
CPU_DEFAULT_KV_TOKENS = 131_072


__all__ = ["CPU_DEFAULT_KV_TOKENS", "ModelRunner", "SeqBatchItem"]


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        kv_capacity_tokens: int | None = None,
        kv_memory_fraction: float = 0.5,
        group_decode_attention: bool | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.config.torch_dtype, self.device)
        self.model = load_model(self.model_dir, self.config, self.device, self.dtype)
        cfg = self.config
        # The pool is sized after the weights are on the device, so "free memory" is
        # what is really left for KV.
        capacity = kv_capacity_tokens
        if capacity is None:
            capacity = KVPool.capacity_for_memory(
                cfg.num_hidden_layers,
                cfg.num_key_value_heads,
                cfg.head_dim,
                self.dtype,
                self.device,
                kv_memory_fraction,
            )
            if self.device.type == "cpu":
                # Host RAM is shared with everything else on the machine, and the pool is
                # zero-filled up front: half of it would be tens of GB touched at start.
                capacity = min(capacity, CPU_DEFAULT_KV_TOKENS)
        if capacity <= 0:
            raise ValueError(f"KV pool capacity must be positive, got {capacity} tokens")
        self.pool = KVPool(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            capacity,
            self.dtype,
            self.device,
        )
        self.tokens_computed = 0
        # One padded attention call for all decode items instead of a loop. None: on
        # CUDA only, where it saves ~6 kernel launches per sequence and layer; on CPU
        # the loop measured faster (B=32, L=256: 169 vs 273 ms/step), because the
        # multi-MB padded gather pays for page faults on every fresh allocation.
        if group_decode_attention is None:
            group_decode_attention = self.device.type == "cuda"
        self.group_decode_attention = group_decode_attention

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def capacity(self) -> int:
        """KV slots in the pool: the engine's allocator hands out [0, capacity)."""
        return self.pool.capacity

    def release(self, seq_id: int) -> None:
        """The sequence left the running set; this runner keeps no state per sequence."""

    def _check(self, batch: list[SeqBatchItem]) -> None:
        """Bad items are caller bugs, but a clear error beats a CUDA index assert."""
        if not batch:
            raise ValueError("forward() needs at least one item")
        for i, item in enumerate(batch):
            n = len(item.input_ids)
            if n == 0:
                raise ValueError(f"item {i}: no input_ids to run")
            if item.start_pos < 0:
                raise ValueError(f"item {i}: start_pos {item.start_pos} < 0")
            if len(item.slots) != item.start_pos + n:
                raise ValueError(
                    f"item {i}: {len(item.slots)} slots for start_pos {item.start_pos} "
                    f"+ {n} new tokens"
                )
            if item.start_pos + n > self.max_model_len:
                raise ValueError(
                    f"item {i}: {item.start_pos + n} tokens exceed max_model_len {self.max_model_len}"
                )
            ids = np.asarray(item.input_ids)
            if ids.min() < 0 or ids.max() >= self.config.vocab_size:
                raise ValueError(f"item {i}: token ids must be in [0, {self.config.vocab_size})")
            slots = np.asarray(item.slots)
            if slots.min() < 0 or slots.max() >= self.pool.capacity:
                raise ValueError(f"item {i}: slots must be in [0, {self.pool.capacity})")

    @torch.inference_mode()
    def forward(self, batch: list[SeqBatchItem]) -> torch.Tensor:
        """fp32 logits [sampled items, vocab] of the last input token of each item with
        `sample` set, in batch order; writes the K/V of every new token into its slot."""
        self._check(batch)
        lengths = np.array([len(item.input_ids) for item in batch], dtype=np.int64)
        n_tokens = int(lengths.sum())
        # Everything the model needs from the host, packed into ONE int64 array so a
        # step costs one host-to-device copy: ids | positions | new slots | all slots.
        packed = np.concatenate(
            [
                *(np.asarray(item.input_ids, dtype=np.int64) for item in batch),
                *(
                    np.arange(item.start_pos, item.start_pos + len(item.input_ids))
                    for item in batch
                ),
                *(np.asarray(item.slots[item.start_pos :], dtype=np.int64) for item in batch),
                *(np.asarray(item.slots, dtype=np.int64) for item in batch),
            ]
        )
        dev_packed = torch.from_numpy(packed).to(self.device, non_blocking=True)
        ids_t, pos_t, new_slots = dev_packed[: 3 * n_tokens].view(3, n_tokens)
        all_slots = dev_packed[3 * n_tokens :]
        ctx = self._context(batch, lengths, all_slots, new_slots)
        hidden = self.model(ids_t, pos_t, ctx)
        rows = (np.cumsum(lengths) - 1)[[item.sample for item in batch]]
        last = torch.from_numpy(rows).to(self.device, non_blocking=True)
        self.tokens_computed += n_tokens
        return self.model.compute_logits(hidden[last])

    def _context(
        self,
        batch: list[SeqBatchItem],
        lengths: np.ndarray,
        all_slots: torch.Tensor,
        new_slots: torch.Tensor,
    ) -> ForwardContext:
        """Per-sequence attention spans; decode items (one new token over a cached
        prefix) go into one padded group when there are several of them."""
        q_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        slot_starts = np.concatenate([[0], np.cumsum([len(item.slots) for item in batch])[:-1]])
        decode = [i for i, item in enumerate(batch) if lengths[i] == 1 and item.start_pos > 0]
        if len(decode) < 2 or not self.group_decode_attention:
            decode = []
        in_group = set(decode)
        seqs = tuple(
            SeqSpan(
                q_start=int(q_starts[i]),
                q_end=int(q_starts[i] + lengths[i]),
                start_pos=item.start_pos,
                kv_slots=all_slots[slot_starts[i] : slot_starts[i] + len(item.slots)],
                mask=prefix_causal_mask(item.start_pos, int(lengths[i]), self.device),
            )
            for i, item in enumerate(batch)
            if i not in in_group
        )
        return ForwardContext(
            kv=self.pool,
            new_slots=new_slots,
            seqs=seqs,
            decode=self._decode_group(batch, decode) if decode else None,
        )

    def _decode_group(self, batch: list[SeqBatchItem], members: list[int]) -> DecodeGroup:
        # A decode item's one query row is where its token sits in the flat batch.
        rows = np.cumsum([len(item.input_ids) for item in batch])[members] - 1
        kv_lens = np.array([len(batch[i].slots) for i in members], dtype=np.int64)
        padded = np.zeros((len(members), int(kv_lens.max())), dtype=np.int64)  # pad: slot 0, masked
        for r, i in enumerate(members):
            padded[r, : kv_lens[r]] = batch[i].slots
        packed = torch.from_numpy(np.concatenate([rows, kv_lens, padded.ravel()]))
        packed = packed.to(self.device, non_blocking=True)
        b = len(members)
        rows_t, lens_t, slots_t = packed[:b], packed[b : 2 * b], packed[2 * b :].view(b, -1)
        positions = torch.arange(slots_t.shape[1], device=self.device)
        mask = (positions[None, :] < lens_t[:, None])[:, None, None, :]
        return DecodeGroup(rows=rows_t, slots=slots_t, mask=mask)
