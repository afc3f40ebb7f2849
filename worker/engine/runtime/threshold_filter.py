"""top-k / top-p / min_p without sorting the vocabulary: each cut is a threshold.

A row keeps the tokens at or above a per-row threshold, found without a sort:

    top-k   the k-th largest logit, from `torch.topk` over the largest k any row
            asks for (a partial selection, not a sort of the vocabulary)
    top-p   the largest probability t such that the tokens with p >= t hold at
            least top_p of the mass: a radix select over the bits of the fp32
            probabilities (non-negative floats order like their bit patterns), by
            mass histograms: 11, 10 and 10 bits of the threshold in three passes
            over the row, each a scatter-add into a small histogram, then a
            suffix sum over it. No data-dependent loop, so no host synchronisation
            (FlashInfer's sampler finds the same threshold by pivots in a kernel)
    min_p   min_p x the largest probability

The kept set is the sorted reference's (`sorted_reference`: sort, cumulative sum)
with one difference, on purpose: tokens tied with the last one kept are all kept
(a threshold cannot split equal values; the sorted version splits them by an
arbitrary sort order). A row with top_p = 1 keeps its whole distribution: no cut
is computed for it, so no rounding of a sum can drop its tail.

Reproducibility: on CPU the same logits give the same kept set every time. On CUDA
the histograms' scatter-adds are atomic, so their fp32 sums may round differently
from run to run; only a token whose inclusion is decided within ~1e-7 of top_p can
flip (a seeded request then repeats except in that case). Not measured on a GPU.
"""

from __future__ import annotations

import torch

# The threshold's 31 value bits (the sign is 0), high to low: 11 + 10 + 10.
_LEVELS = ((20, 11), (10, 10), (0, 10))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B] the largest t with sum(p[p >= t]) >= top_p, per row (probs [B, V] fp32 >= 0).

    Radix select on the bit pattern: at each level the row's mass is histogrammed by
    the next bits among the tokens that share the bits chosen so far; the level's
    bits are the highest bucket whose mass, plus everything above the bucket, still
    reaches top_p."""
    b = probs.shape[0]
    bits = probs.contiguous().view(torch.int32)
    prefix = torch.zeros(b, dtype=torch.int32, device=probs.device)  # bits chosen so far
    above = torch.zeros(b, dtype=probs.dtype, device=probs.device)  # mass above them
    need = top_p.to(probs.dtype)
    for level, (shift, width) in enumerate(_LEVELS):
        key = (bits >> shift) & ((1 << width) - 1)
        if level == 0:
            mass = probs
        else:
            high = shift + width  # the bits chosen at the levels before
            same = (bits >> high) == (prefix >> high)[:, None]
            mass = torch.where(same, probs, 0.0)
        hist = torch.zeros(b, 1 << width, dtype=probs.dtype, device=probs.device)
        hist.scatter_add_(1, key.long(), mass)
        # suffix[j] = mass of buckets >= j, plus the mass above this level's range
        suffix = hist.flip(1).cumsum(1).flip(1) + above[:, None]
        ok = suffix >= need[:, None]
        # the highest bucket that still reaches top_p (bucket 0 when none does: the
        # sum of every probability fell short by rounding; keep everything)
        j = (ok * torch.arange(1, (1 << width) + 1, device=probs.device)).amax(1) - 1
        j = j.clamp(min=0)
        nxt = (j + 1).clamp(max=(1 << width) - 1)
        above = torch.where(j + 1 < (1 << width), suffix.gather(1, nxt[:, None])[:, 0], above)
        prefix = prefix | (j.to(torch.int32) << shift)
    return prefix.view(torch.float32).to(probs.dtype)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    *,
    max_k: int = 0,
) -> torch.Tensor:
    """Probabilities [B, V] in vocabulary order after temperature and the cuts.

    `top_k` [B] (a row without a cut holds V), `top_p` [B], `min_p` [B]: None when no
    row of the batch uses that cut (decided on the host from the parameters); `max_k`
    is the largest top_k of a row that has one."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    if top_k is not None and max_k > 0:
        kth = logits.topk(min(max_k, vocab), dim=-1).values
        index = (top_k.long().clamp(1, min(max_k, vocab)) - 1)[:, None]
        cut = torch.where(top_k >= vocab, float("-inf"), kth.gather(1, index)[:, 0])
        logits = logits.masked_fill(logits < cut[:, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    keep = None
    if top_p is not None:
        t = top_p_threshold(probs, top_p)
        t = torch.where(top_p >= 1, 0.0, t)  # top_p = 1: no cut at all
        keep = probs >= t[:, None]
    if min_p is not None:
        floor = min_p * probs.amax(dim=-1)
        above = probs >= floor[:, None]
        keep = above if keep is None else keep & above
    if keep is None:
        return probs
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def sorted_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The same cuts by a full sort and a cumulative sum (tests and the benchmark),
    in vocabulary order; top_p = 1 keeps the whole row."""
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1), 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, probs)
