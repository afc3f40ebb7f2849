"""Next-token sampling for a batch, on the device the logits live on.

    logits -> penalties (presence, frequency, repetition) -> logit_bias
           -> greedy argmax | temperature, top-k, top-p, min_p, then a draw

Every stage is one batched tensor operation over the rows that need it (no Python loop
over the vocabulary): token counts for the penalties come from one scatter of the
sequences' ids, biases from one index_put. Greedy rows take one argmax; the others
share one sort for top-k/top-p and one softmax. A seeded request draws from its own
`torch.Generator` (seed + choice index), created on first use and kept until
`release`, so its tokens depend only on its seed and its logits, not on which other
requests share the batch. Unseeded rows draw together from the sampler's generator.

Log-probabilities (`logprobs`, `top_logprobs`) are the log-softmax of the model's
logits at temperature 1, before penalties and biases, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from worker.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from worker.engine.sequence import Req


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._rng = torch.Generator(device=self.device)
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}  # seq_id -> generator

    def release(self, seq_id: int) -> None:
        """Forget a finished request's generator."""
        self._seeded.pop(seq_id, None)

    def sample(
        self, logits: torch.Tensor, reqs: list[Req]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """The engine's call: one (token, logprob or None) per request, in order."""
        if not reqs:
            return []
        params = [r.params for r in reqs]
        tokens = self.pick(
            logits,
            params,
            [r.seq_id for r in reqs],
            outputs=[r.output_ids for r in reqs],
            prompts=[r.prompt_ids for r in reqs],
            seeds=[None if r.params.seed is None else r.params.seed + r.index for r in reqs],
        )
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        rows = [i for i, p in enumerate(params) if p.needs_logprobs]
        if rows:
            for i, lp in zip(rows, _logprobs(logits, rows, tokens, params), strict=True):
                logprobs[i] = lp
        return list(zip(tokens, logprobs, strict=True))

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
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        logits = _penalize(logits, params, outputs or [()] * len(params), prompts)
        logits = _bias(logits, params)
        out = [0] * len(params)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        if len(greedy) == len(params):  # the common case: one argmax, no row gather
            return logits.argmax(dim=-1).tolist()
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            for i, tok in zip(greedy, picked, strict=True):
                out[i] = tok
        rand = [i for i, p in enumerate(params) if p.temperature > 0]
        if rand:
            sub = [params[i] for i in rand]
            probs, order = _filtered_probs(logits[rand].float(), sub)
            seeds = seeds or [p.seed for p in params]
            picked = self._draw(probs, order, [seeds[i] for i in rand], [seq_ids[i] for i in rand])
            for i, tok in zip(rand, picked, strict=True):
                out[i] = tok
        return out

    def _draw(
        self,
        probs: torch.Tensor,
        order: torch.Tensor | None,
        seeds: list[int | None],
        seq_ids: list[int],
    ) -> list[int]:
        ranks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        plain = [i for i, s in enumerate(seeds) if s is None]
        if plain:
            ranks[plain] = torch.multinomial(probs[plain], 1, generator=self._rng).squeeze(1)
        for i, (seed, seq_id) in enumerate(zip(seeds, seq_ids, strict=True)):
            if seed is not None:
                gen = self._generator(seq_id, seed)
                ranks[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        if order is None:
            return ranks.tolist()
        return order.gather(1, ranks.unsqueeze(1)).squeeze(1).tolist()

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        gen = self._seeded.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._seeded[seq_id] = gen
        return gen


def _counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrences of each token id: one padded scatter."""
    width = max((len(x) for x in ids), default=0)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    if width:
        padded = torch.full((len(ids), width), vocab, dtype=torch.long)  # pad: a spare column
        for r, x in enumerate(ids):
            padded[r, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        padded = padded.to(device, non_blocking=True)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    rows = [
        i
        for i, p in enumerate(params)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
    ]
    if not rows:
        return logits
    logits = logits.float().clone()
    dev, vocab = logits.device, logits.shape[1]
    sub = logits[rows]
    counts = _counts([outputs[i] for i in rows], vocab, dev)
    col = lambda name: torch.tensor([getattr(params[i], name) for i in rows], device=dev)[:, None]  # noqa: E731
    rep = col("repetition_penalty")
    if (rep != 1).any():
        seen = counts > 0
        if prompts is not None:
            seen |= _counts([prompts[i] for i in rows], vocab, dev) > 0
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, scaled, sub)
    sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0)
    logits[rows] = sub
    return logits


def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    entries = [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias]
    if not entries:
        return logits
    logits = logits.float().clone()
    r, c, v = zip(*entries, strict=True)
    dev = logits.device
    index = (torch.tensor(r, device=dev), torch.tensor(c, device=dev))
    logits.index_put_(index, torch.tensor(v, device=dev, dtype=logits.dtype), accumulate=True)
    return logits


def _filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature, top-k, top-p and min_p; with a cut they come
    in descending-logit order and `order` maps a rank back to its token id."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    logits = logits / temps
    if all(p.top_k == -1 and p.top_p == 1 and p.min_p == 0 for p in params):
        return logits.softmax(dim=-1), None  # no cut: skip the vocab-wide sort
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    if any(p.top_k != -1 for p in params):
        ks = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params], device=dev)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    if any(p.top_p < 1 for p in params):
        top_ps = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
        # Drop a token when the tokens ranked above it already cover top_p; the most
        # likely token always stays.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_ps, 0.0)
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < min_ps * probs[:, :1], 0.0)  # column 0: the best
    return probs / probs.sum(dim=-1, keepdim=True), order


def _logprobs(
    logits: torch.Tensor, rows: list[int], tokens: list[int], params: list[SamplingParams]
) -> list[TokenLogprob]:
    logp = logits[rows].float().log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows], device=logp.device)[:, None])
    k = max(params[i].top_logprobs for i in rows)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    chosen_l, top_vl, top_il = chosen[:, 0].tolist(), top_v.tolist(), top_i.tolist()
    out = []
    for r, i in enumerate(rows):
        n = params[i].top_logprobs
        top = tuple(zip(top_il[r][:n], top_vl[r][:n], strict=True))
        out.append(TokenLogprob(tokens[i], chosen_l[r], top))
    return out
