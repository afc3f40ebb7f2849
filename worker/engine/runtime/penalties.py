"""What a batch's own parameters do to its logits before the sampler draws: presence,
frequency and repetition penalties (`penalize`) and `logit_bias` (`add_logit_bias`), each
one batched tensor operation, and the token counts the penalties need (`PenaltyCounts`).

The counts are kept on the device per running sequence.

Presence and frequency penalties need each sequence's output-token counts, the
repetition penalty also which tokens its prompt holds. Rebuilt every step, that is
host work and a host->device copy that grow with the sequence (its whole prompt and
output, every step). Here each sequence that asks for penalties owns a row of a
[rows, vocab] table on the device, filled from its prompt once, and each step adds
only the tokens sampled since (usually one): per step O(batch + new tokens), whatever
the lengths. `release` frees a row; row 0 stays zero, for batch rows without penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.engine.runtime.attention.metadata import Staging
from worker.engine.types import SamplingParams


class PenaltyCounts:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None  # [rows, vocab] float: output counts
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool: in the prompt
        self._row: dict[int, int] = {}  # seq_id -> row
        self._known: dict[int, int] = {}  # seq_id -> output tokens already counted
        self._free: list[int] = []

    def tables(
        self,
        vocab: int,
        seq_ids: Sequence[int],
        outputs: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]],
        penalized: Sequence[bool],
        staging: Staging,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, prompt seen), [batch, vocab] each, for the batch in order."""
        if self.counts is None or self.counts.shape[1] != vocab:
            self._reset(vocab, rows=16)
        rows, added, prompt = [], [], []
        for seq_id, out, ids, pen in zip(seq_ids, outputs, prompts, penalized, strict=True):
            if not pen:
                rows.append(0)
                continue
            row = self._row.get(seq_id)
            if row is None or len(out) < self._known[seq_id]:  # new (or not append-only)
                row = self._take(seq_id)
                prompt += [row * vocab + t for t in ids]  # once per sequence
            added += [row * vocab + t for t in out[self._known[seq_id] :]]
            self._known[seq_id] = len(out)
            rows.append(row)
        assert self.counts is not None and self.seen is not None
        if added:
            index = staging.upload(np.array(added, dtype=np.int64))
            self.counts.view(-1).index_add_(0, index, torch.ones(len(added), device=self.device))
        if prompt:
            # index_fill_ takes the value as a kernel argument (an assignment of a Python
            # bool may first copy it to the device).
            self.seen.view(-1).index_fill_(0, staging.upload(np.array(prompt, np.int64)), True)
        index = staging.upload(np.array(rows, dtype=np.int64))
        return self.counts[index], self.seen[index]

    def release(self, seq_id: int) -> None:
        row = self._row.pop(seq_id, None)
        if row is not None:
            del self._known[seq_id]
            self._free.append(row)

    def _take(self, seq_id: int) -> int:
        self.release(seq_id)
        if not self._free:
            self._grow()
        row = self._row[seq_id] = self._free.pop()
        self._known[seq_id] = 0
        assert self.counts is not None and self.seen is not None
        self.counts[row].zero_()
        self.seen[row].zero_()
        return row

    def _reset(self, vocab: int, rows: int) -> None:
        self.counts = torch.zeros(rows, vocab, device=self.device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        self._row.clear()
        self._known.clear()
        self._free = list(range(rows - 1, 0, -1))  # row 0: the zero row

    def _grow(self) -> None:
        assert self.counts is not None and self.seen is not None
        n, vocab = self.counts.shape
        counts, seen = self.counts, self.seen
        self.counts = torch.zeros(2 * n, vocab, device=self.device)
        self.seen = torch.zeros(2 * n, vocab, dtype=torch.bool, device=self.device)
        self.counts[:n] = counts
        self.seen[:n] = seen
        self._free = list(range(2 * n - 1, n - 1, -1))


def _counts(
    ids: Sequence[Sequence[int]], vocab: int, device: torch.device, staging: Staging
) -> torch.Tensor:
    """[rows, vocab] occurrences of each token id: one padded scatter."""
    width = max((len(x) for x in ids), default=0)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    if width:
        padded = np.full((len(ids), width), vocab, dtype=np.int64)  # pad: a spare column
        for r, x in enumerate(ids):
            padded[r, : len(x)] = x
        index = staging.upload(padded)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab]


def penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]] | None,
    staging: Staging | None = None,
    columns: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Penalties on every row (a row without any has neutral values: 1, 0, 0). The
    counts come from `tables` (output counts, prompt seen; the engine's sequences keep
    theirs on the device) or are counted here from `outputs` and `prompts`. `columns`:
    [batch, 3] repetition, frequency and presence penalties on the device (the
    sampler's parameter columns); None: uploaded here."""
    if not any(p.penalized for p in params):
        return logits
    dev, vocab = logits.device, logits.shape[1]
    staging = staging or Staging(dev)
    if columns is None:
        rows = [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params]
        columns = staging.upload(np.array(rows, dtype=np.float32).reshape(len(params), 3))
    logits = logits.float()
    counts = _counts(outputs, vocab, dev, staging) if tables is None else tables[0]
    if any(p.repetition_penalty != 1 for p in params):
        seen = counts > 0
        if tables is not None:
            seen |= tables[1]
        elif prompts is not None:
            seen |= _counts(prompts, vocab, dev, staging) > 0
        rep = columns[:, 0, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - columns[:, 1, None] * counts - columns[:, 2, None] * (counts > 0)


def add_logit_bias(
    logits: torch.Tensor, params: list[SamplingParams], staging: Staging | None = None
) -> torch.Tensor:
    entries = [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias]
    if not entries:
        return logits
    staging = staging or Staging(logits.device)
    logits = logits.float().clone()
    vocab = logits.shape[1]
    # One scatter_add over the flat logits (no sort, unlike an accumulating index_put).
    flat = staging.upload(np.array([r * vocab + c for r, c, _ in entries], dtype=np.int64))
    values = staging.upload(np.array([b for _, _, b in entries], dtype=np.float32))
    logits.view(-1).scatter_add_(0, flat, values)
    return logits
