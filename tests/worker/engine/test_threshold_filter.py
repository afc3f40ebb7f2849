"""top-k / top-p / min_p by thresholds (no vocabulary sort) keep exactly the tokens the
sorted reference keeps, ties excepted (a threshold keeps every token tied with the
last one kept), and sampling through them stays seeded and batch-independent."""

from __future__ import annotations

import collections

import pytest
import torch

from worker.engine.runtime.sampler import TorchSampler
from worker.engine.runtime.threshold_filter import filtered_probs, sorted_reference, top_p_threshold
from worker.engine.types import SamplingParams


def random_rows(rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Scales from flat to very peaked; cuts on, off and at their edges.
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 8)
    top_k = torch.randint(1, vocab // 4, (rows,), generator=g).float()
    top_k[::3] = vocab  # no top-k
    top_p = torch.rand(rows, generator=g)
    top_p[::4] = 1.0
    top_p[1::7] = 0.999
    min_p = torch.rand(rows, generator=g) * 0.3
    min_p[::2] = 0.0
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    return dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


@pytest.mark.parametrize("vocab", [50, 1000, 5003])
def test_kept_set_equals_the_sorted_reference(vocab: int) -> None:
    rows = random_rows(300, vocab, seed=vocab)
    want = sorted_reference(**rows)
    max_k = int(rows["top_k"][rows["top_k"] < vocab].max())
    got = filtered_probs(**rows, max_k=max_k)
    differ = ((got > 0) != (want > 0)).any(dim=1).nonzero()[:, 0].tolist()
    for r in differ:  # only where a fp32 sum's rounding decides (|mass - top_p| ~ 1e-7)
        assert _on_the_top_p_edge(rows, r, got[r] > 0, want[r] > 0), r
    assert len(differ) <= 2
    same = [r for r in range(300) if r not in differ]
    torch.testing.assert_close(got[same], want[same], atol=1e-6, rtol=1e-5)


def test_on_a_real_vocabulary_closer_to_fp64_than_the_sort() -> None:
    """Flat rows over 151,936 tokens (top_p 0.9 keeps ~600-2,300): where the kept sets
    differ, it is the fp32 sums' rounding at the edge; against an fp64 sorted
    reference the thresholds are off on no more rows than the fp32 sort."""
    g = torch.Generator().manual_seed(8)
    rows, vocab = 12, 151_936
    args = dict(logits=torch.randn(rows, vocab, generator=g) * 3,
                temperature=torch.full((rows,), 0.8), top_k=torch.full((rows,), float(vocab)),
                top_p=torch.full((rows,), 0.9), min_p=torch.zeros(rows))  # fmt: skip
    exact = sorted_reference(**{k: v.double() for k, v in args.items()}) > 0
    by_sort = sorted_reference(**args) > 0
    by_threshold = (
        filtered_probs(args["logits"], args["temperature"], None, args["top_p"], None) > 0
    )
    off_sort = (by_sort ^ exact).sum(dim=1)
    off_threshold = (by_threshold ^ exact).sum(dim=1)
    assert off_threshold.max() <= 1 and off_sort.max() <= 1  # one token at the edge at most
    assert (off_threshold > 0).sum() <= (off_sort > 0).sum()


def _on_the_top_p_edge(rows: dict, r: int, got: torch.Tensor, want: torch.Tensor) -> bool:
    """The tokens kept by one side only sit where the mass ranked above them equals
    top_p to within fp32 rounding (two sums of the same numbers in another order)."""
    p = (rows["logits"][r] / rows["temperature"][r]).softmax(-1).double()
    before = torch.stack([p[p > x].sum() for x in p[got ^ want]])
    return bool(((before - rows["top_p"][r].double()).abs() < 1e-6).all())


def test_each_cut_alone_equals_the_reference() -> None:
    rows = random_rows(200, 700, seed=1)
    vocab = 700
    off = dict(
        top_k=torch.full((200,), float(vocab)), top_p=torch.ones(200), min_p=torch.zeros(200)
    )
    for cut in ("top_k", "top_p", "min_p"):
        args = dict(rows, **{k: v for k, v in off.items() if k != cut})
        want = sorted_reference(**args)
        kw = {k: (args[k] if k == cut else None) for k in ("top_k", "top_p", "min_p")}
        got = filtered_probs(args["logits"], args["temperature"], **kw, max_k=vocab // 4)
        assert torch.equal(got > 0, want > 0), cut


def test_ties_at_the_edge_are_all_kept() -> None:
    # probs .4 .2 .2 .1 .1: top_p .5 stops inside the tie at .2 (the sort keeps one
    # of the two, by its order); top_k 4 splits the tie at .1.
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    one = torch.ones(1)
    t = top_p_threshold(logits.softmax(-1), torch.tensor([0.5]))
    assert t.item() == pytest.approx(0.2)
    got = filtered_probs(logits, one, None, torch.tensor([0.5]), None)
    assert (got > 0).tolist() == [[True, True, True, False, False]]
    ref = sorted_reference(logits, one, torch.tensor([5.0]), torch.tensor([0.5]), torch.zeros(1))
    assert (ref > 0).sum().item() == 2  # the sort kept one of the tied pair
    got = filtered_probs(logits, one, torch.tensor([4.0]), None, None, max_k=4)
    assert (got > 0).tolist() == [[True, True, True, True, True]]


def test_top_p_one_keeps_the_whole_row_next_to_a_cut_row() -> None:
    """A row's kept set does not depend on its batch mates: with a row at top_p 0.5
    in the batch, a top_p = 1 row over a 151,936-token vocabulary keeps every token
    (the cumulative fp32 sum reaches 1.0 before the tail; no cut is computed)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 151_936, generator=g) * 4
    logits[:, :10] += 20  # peaked: the tail's mass is below fp32's resolution of 1.0
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0)]
    from worker.engine.runtime.sampler import _columns, _filtered_probs

    cols = torch.from_numpy(_columns(params, logits.shape[1]))
    probs, order = _filtered_probs(logits, params, cols)
    assert order is None
    assert (probs[1] > 0).all()
    assert 0 < (probs[0] > 0).sum().item() < 10
    alone, _ = _filtered_probs(logits[1:], params[1:], cols[1:])
    torch.testing.assert_close(probs[1], alone[0])


def test_draws_follow_the_cut_distribution() -> None:
    # probs .5 .3 .15 .05, top_p .7: {0, 1} with .625 / .375.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = TorchSampler(seed=9)
    params = [SamplingParams(temperature=1.0, top_p=0.7)]
    counts = collections.Counter(sampler.pick(logits, params, [0])[0] for _ in range(2000))
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.625) < 0.04


def test_seeded_draws_repeat_with_cuts_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 500, generator=g) * 2
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, seed=7)
    other = SamplingParams(temperature=1.3, top_p=0.3)
    runs = []
    for mates in ([other, other], [SamplingParams(temperature=0)] * 2):
        sampler = TorchSampler(seed=len(runs))
        runs.append([
            sampler.pick(logits, [seeded, *mates], [0, 1, 2], seeds=[7, None, None])[0]
            for _ in range(15)
        ])  # fmt: skip
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # it did sample
