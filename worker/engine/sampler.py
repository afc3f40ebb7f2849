"""Next-token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds.

Works on the runner's fp32 logits on whatever device they live. Greedy rows take one
batched argmax; the other rows share one sort for top-k/top-p and one softmax. A
seeded request draws from its own `torch.Generator`, created on first use and kept
until `release`, so its tokens depend only on its seed and its logits — not on which
other requests share the batch. Unseeded rows draw together from the sampler's own
generator.
"""

from __future__ import annotations

import torch

from worker.engine.types import SamplingParams


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
        self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]
    ) -> list[int]:
        """One token per row of `logits` [batch, vocab]."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
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
            probs, order = self._filtered_probs(logits[rand].float(), [params[i] for i in rand])
            picked = self._draw(probs, order, [params[i] for i in rand], [seq_ids[i] for i in rand])
            for i, tok in zip(rand, picked, strict=True):
                out[i] = tok
        return out

    def _filtered_probs(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Probabilities after temperature, top-k and top-p; with a cut they come in
        descending-logit order and `order` maps a rank back to its token id."""
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        logits = logits / temps
        if all(p.top_k == -1 and p.top_p == 1 for p in params):
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
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs, order

    def _draw(
        self,
        probs: torch.Tensor,
        order: torch.Tensor | None,
        params: list[SamplingParams],
        seq_ids: list[int],
    ) -> list[int]:
        ranks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        plain = [i for i, p in enumerate(params) if p.seed is None]
        if plain:
            ranks[plain] = torch.multinomial(probs[plain], 1, generator=self._rng).squeeze(1)
        for i, (p, seq_id) in enumerate(zip(params, seq_ids, strict=True)):
            if p.seed is not None:
                gen = self._generator(seq_id, p.seed)
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
