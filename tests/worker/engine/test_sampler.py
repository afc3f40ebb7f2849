"""TorchSampler: greedy, temperature, top-k, top-p and per-request seeds, batched."""

from __future__ import annotations

import collections

import torch

from worker.engine.runtime.sampler import TorchSampler, _filtered_probs
from worker.engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0)


def test_greedy_takes_the_argmax_of_each_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert TorchSampler(seed=0).pick(logits, [GREEDY, GREEDY], [0, 1]) == [1, 0]


def test_top_k_one_is_greedy_even_when_hot() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    for _ in range(5):
        assert TorchSampler().pick(logits, params, [0, 1, 2, 3]) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    sampler = TorchSampler(seed=1)
    seen = {
        sampler.pick(logits, [SamplingParams(temperature=10.0, top_k=3)], [0])[0]
        for _ in range(300)
    }
    assert seen == {0, 1, 2}


def test_top_p_cuts_the_tail_but_keeps_the_best_token() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1}; a tiny top_p keeps {0}.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = TorchSampler(seed=2)
    wide = {sampler.pick(logits, [SamplingParams(top_p=0.7)], [0])[0] for _ in range(300)}
    narrow = {sampler.pick(logits, [SamplingParams(top_p=0.01)], [0])[0] for _ in range(50)}
    assert wide == {0, 1}
    assert narrow == {0}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    sampler = TorchSampler(seed=3)
    counts = collections.Counter(
        sampler.pick(logits, [SamplingParams(temperature=1.0)], [0])[0] for _ in range(3000)
    )
    assert abs(counts[0] / 3000 - 0.6) < 0.05
    assert abs(counts[2] / 3000 - 0.1) < 0.03


def test_low_temperature_sharpens_high_temperature_flattens() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    sampler = TorchSampler(seed=4)

    def share_of_best(t: float) -> float:
        picks = [sampler.pick(logits, [SamplingParams(temperature=t)], [0])[0] for _ in range(1000)]
        return picks.count(0) / 1000

    assert share_of_best(0.1) > 0.99
    assert 0.45 < share_of_best(100.0) < 0.55


def test_seeded_requests_repeat_whatever_shares_the_batch() -> None:
    vocab = 200
    rows = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_noise: bool) -> list[int]:
        sampler = TorchSampler()  # randomly seeded: only the request's own seed may matter
        out = []
        for step in range(6):
            logits = rows[step : step + 1]
            params, ids = [seeded], [7]
            if batch_noise:
                logits = torch.cat([torch.randn(3, vocab), logits, torch.randn(2, vocab)])
                params = (
                    [SamplingParams(temperature=1.0)] * 3 + params + [SamplingParams(seed=9)] * 2
                )
                ids = [1, 2, 3, 7, 8, 9]
            picked = sampler.pick(logits, params, ids)
            out.append(picked[params.index(seeded)])
        return out

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_release_restarts_a_seeded_stream() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=42)]
    sampler = TorchSampler()
    first = [sampler.pick(logits, params, [0])[0] for _ in range(4)]
    sampler.release(0)
    assert [sampler.pick(logits, params, [0])[0] for _ in range(4)] == first


def test_mixed_batch_greedy_rows_unaffected() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(6))
    params = [
        GREEDY,
        SamplingParams(temperature=2.0, top_p=0.9, top_k=10),
        GREEDY,
        SamplingParams(seed=1),
        GREEDY,
    ]
    out = TorchSampler(seed=0).pick(logits, params, list(range(5)))
    best = logits.argmax(-1).tolist()
    assert [out[0], out[2], out[4]] == [best[0], best[2], best[4]]
    assert all(0 <= t < 30 for t in out)


QWEN_VOCAB = 151_936  # a large vocabulary: fp32 cumulative sums reach 1.0 before its end


def test_top_p_one_keeps_every_token_whatever_shares_the_batch() -> None:
    """A row with top_p = 1 keeps its whole tail, and a seeded request draws the same
    tokens, whether or not another row of its batch cuts with top_p < 1 (once, the
    fp32 cumulative sum of the shared sort reached 1.0 and cut ~10% of its vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(8, QWEN_VOCAB, generator=gen) * 3  # row 0: 15,235 tokens were cut
    mine = SamplingParams(temperature=1.0, seed=77)
    other = SamplingParams(temperature=1.0, top_p=0.5)
    cols = torch.tensor([[1.0, QWEN_VOCAB, p.top_p, 0, 1, 0, 0, 0] for p in (mine, other)])
    probs, order = _filtered_probs(rows[:2], [mine, other], cols)
    assert order is None  # vocabulary order: the cuts are thresholds, nothing is sorted
    assert int((probs[0] > 0).sum()) == QWEN_VOCAB  # every token of the top_p = 1 row
    torch.testing.assert_close(probs[0], rows[0].softmax(-1), rtol=1e-4, atol=1e-9)

    def draws(partner: bool) -> list[int]:
        sampler = TorchSampler()  # unseeded: only the request's own seed may matter
        out = []
        for step in range(8):
            logits, params = rows[step : step + 1], [mine]
            if partner:
                logits, params = torch.cat([logits, rows[(step + 1) % 8 :][:1]]), [mine, other]
            out.append(sampler.pick(logits, params, [0, 1][: len(params)])[0])
        return out

    assert draws(partner=True) == draws(partner=False)
