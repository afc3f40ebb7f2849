"""Next-token sampling for a batch, on the device the logits live on.

    logits -> penalties (presence, frequency, repetition) -> logit_bias
           -> greedy argmax | temperature, top-k, top-p, min_p, then a draw

Every stage is one batched tensor operation over the whole batch (no Python loop over
the vocabulary), and the host waits for the device once per step: the per-row
parameters go up in one asynchronous copy (`Staging`, pinned memory on CUDA), and
the chosen ids, their log-probabilities and the top alternatives come back packed in
one tensor, read with one `.tolist()` (tests/worker/engine/test_host_syncs.py counts
it; the GPU check counts it with CUDA's sync debug mode). Which stages run is decided
on the host from the parameters alone, never from a device value.

Token counts for the penalties come from one scatter of the sequences' ids, biases
from one index_put. Every row takes the argmax; if any row samples, all rows share
one softmax and the top-k/top-p/min_p cuts, each a per-row threshold found without
sorting the vocabulary (threshold_filter.py), and a draw is the argmax of p / E with E
exponential(1) noise (the exponential race: the same distribution as a multinomial
draw, without `torch.multinomial`'s validity check, which reads a device value). A
seeded request draws its noise from its own `torch.Generator` (seed + choice index),
created on first use and kept until `release`, so its tokens depend only on its seed
and its logits, not on which other requests share the batch. Unseeded rows draw
together from the sampler's generator.

Log-probabilities (`logprobs`, `top_logprobs`) are the log-softmax of the model's
logits at temperature 1, before penalties and biases, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.engine.runtime.attention.metadata import Staging
from worker.engine.runtime.penalties import PenaltyCounts, add_logit_bias, penalize
from worker.engine.runtime.threshold_filter import filtered_probs
from worker.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from worker.engine.req import Req


# Columns of the per-row parameter array (float32; token ids < 2**24 stay exact);
# repetition, frequency, presence in a row: `penalize`'s columns.
_TEMP, _TOP_K, _TOP_P, _MIN_P, _REP, _FREQ, _PRES, _GREEDY = range(8)


class TorchSampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._rng = torch.Generator(device=self.device)
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}  # seq_id -> generator
        self._staging = Staging(self.device)
        self._penalties = PenaltyCounts(self.device)

    def release(self, seq_id: int) -> None:
        """Forget a finished request's generator and penalty counts."""
        self._seeded.pop(seq_id, None)
        self._penalties.release(seq_id)

    def sample(
        self, logits: torch.Tensor, reqs: list[Req]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One (token, logprob or None) per request, in order; waits for the device."""
        return self.launch(logits, reqs).result()

    def launch(self, logits: torch.Tensor, reqs: list[Req]) -> Sampled:
        """The engine's call: the step's draws enqueued on the device, read later
        (`Sampled.result`), so the host can schedule the next step meanwhile."""
        params = [r.params for r in reqs]
        if not reqs:
            return Sampled(None, params, self.device)
        seq_ids = [r.seq_id for r in reqs]
        tables = None
        if any(p.penalized for p in params):  # counts kept on the device (penalties.py)
            tables = self._penalties.tables(
                logits.shape[1], seq_ids, [r.output_ids for r in reqs],
                [r.prompt_ids for r in reqs], [p.penalized for p in params], self._staging,
            )  # fmt: skip
        packed = self._packed(
            logits,
            params,
            seq_ids,
            outputs=None,
            prompts=None,
            seeds=[None if r.params.seed is None else r.params.seed + r.index for r in reqs],
            with_logprobs=any(p.needs_logprobs for p in params),
            tables=tables,
        )
        return Sampled(packed, params, self.device)

    def pick(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        outputs: Sequence[Sequence[int]] | None = None,
        prompts: Sequence[Sequence[int]] | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> list[int]:
        """One token per row of `logits` [batch, vocab]."""
        packed = self._packed(logits, params, seq_ids, outputs, prompts, seeds, False, None)
        return [int(t) for t in packed[:, 0].tolist()]

    def _packed(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        outputs: Sequence[Sequence[int]] | None,
        prompts: Sequence[Sequence[int]] | None,
        seeds: Sequence[int | None] | None,
        with_logprobs: bool,
        tables: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """[batch, 2 + 2k] float64 on the device: token, its logprob, the k best
        logprobs, their ids (k = the largest top_logprobs; logprob columns only
        `with_logprobs`). Nothing here waits for the device."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        sampling = any(p.temperature > 0 for p in params)
        cols = None  # the per-row parameters, uploaded only when a stage needs them
        if sampling or any(p.penalized for p in params):
            cols = self._staging.upload(_columns(params, logits.shape[1]))
        raw = logits
        penalties = None if cols is None else cols[:, _REP : _PRES + 1]
        logits = penalize(logits, params, outputs or [()] * len(params), prompts,
                          self._staging, penalties, tables)  # fmt: skip
        logits = add_logit_bias(logits, params, self._staging)
        ids = logits.argmax(dim=-1)
        if sampling:
            assert cols is not None
            seeds = seeds or [p.seed for p in params]
            drawn = self._draw(logits.float(), params, cols, seeds, seq_ids)
            ids = torch.where(cols[:, _GREEDY] > 0, ids, drawn)
        parts = [ids.double()[:, None]]
        if not with_logprobs:
            return parts[0]
        logp = raw.float().log_softmax(dim=-1)
        k = max(p.top_logprobs for p in params)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        parts += [logp.gather(1, ids[:, None]).double(), top_v.double(), top_i.double()]
        return torch.cat(parts, dim=1)

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        cols: torch.Tensor,
        seeds: Sequence[int | None],
        seq_ids: list[int],
    ) -> torch.Tensor:
        probs, order = _filtered_probs(logits, params, cols)
        noise = torch.empty_like(probs).exponential_(generator=self._rng)
        for i, (seed, seq_id) in enumerate(zip(seeds, seq_ids, strict=True)):
            if seed is not None and params[i].temperature > 0:
                noise[i].exponential_(generator=self._generator(seq_id, seed))
        if order is None:
            return (probs / noise).argmax(dim=-1)
        # Noise belongs to token ids, not ranks: whether this row was sorted (some row of
        # the batch cuts) must not change a seeded request's draw.
        ranks = (probs / noise.gather(1, order)).argmax(dim=-1)
        return order.gather(1, ranks.unsqueeze(1)).squeeze(1)

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        gen = self._seeded.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._seeded[seq_id] = gen
        return gen


class Sampled:
    """One step's draws, packed on the device: `ids` (int64, one per request) stay
    there for the next step's input (runner.FutureTokens); `result()` reads the packed
    rows back once. On CUDA the copy to pinned memory is enqueued right after the
    draws, so reading it later waits for this step only, not for the step launched
    after it."""

    def __init__(
        self, packed: torch.Tensor | None, params: list[SamplingParams], device: torch.device
    ) -> None:
        self.params = params
        self.ids = None if packed is None else packed[:, 0].long()
        self._host, self._done = packed, None
        if packed is not None and device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> list[tuple[int, TokenLogprob | None]]:
        if self._host is None:
            return []
        if self._done is not None:
            self._done.synchronize()
        rows = self._host.tolist()  # the step's one host synchronisation
        out: list[tuple[int, TokenLogprob | None]] = []
        for row, p in zip(rows, self.params, strict=True):
            token = int(row[0])
            lp = None
            if p.needs_logprobs:
                k, n = (len(row) - 2) // 2, p.top_logprobs
                top = tuple(
                    (int(t), v) for t, v in zip(row[2 + k : 2 + k + n], row[2 : 2 + n], strict=True)
                )
                lp = TokenLogprob(token, row[1], top)
            out.append((token, lp))
        return out


def _columns(params: list[SamplingParams], vocab: int) -> np.ndarray:
    """[batch, 8] float32 per-row parameters, built on the host (see _TEMP...)."""
    return np.array(
        [(p.temperature if p.temperature > 0 else 1.0, p.top_k if p.top_k != -1 else vocab,
          p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
          float(p.temperature == 0)) for p in params],
        dtype=np.float32,
    ).reshape(len(params), 8)  # fmt: skip


def _filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams], cols: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature, top-k, top-p and min_p, in vocabulary order
    (`order` is None: kept for callers of the sorted form). Each cut is a per-row
    threshold found without sorting the vocabulary (threshold_filter.py); which cuts
    run is decided from the parameters on the host."""
    ks = [p.top_k for p in params if p.top_k != -1]
    return filtered_probs(
        logits, cols[:, _TEMP],
        cols[:, _TOP_K] if ks else None,
        cols[:, _TOP_P] if any(p.top_p < 1 for p in params) else None,
        cols[:, _MIN_P] if any(p.min_p > 0 for p in params) else None,
        max_k=max(ks, default=0),
    ), None  # fmt: skip
