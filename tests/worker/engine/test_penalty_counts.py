"""Penalty counts kept on the device per sequence (worker/engine/runtime/penalties.py): the
engine's sampler gives the same tokens as counting everything again each step, and
what it uploads per step does not grow with the sequences' lengths."""

from __future__ import annotations

import torch

from worker.engine.runtime.sampler import TorchSampler
from worker.engine.types import SamplingParams


class Seq:
    def __init__(self, params: SamplingParams, seq_id: int, prompt: list[int]) -> None:
        self.params, self.seq_id, self.index = params, seq_id, 0
        self.prompt_ids, self.output_ids = prompt, []


def test_device_counts_equal_a_full_recount_and_uploads_stay_flat() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    reqs = [
        Seq(SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7), 3,
            [1, 2, 3]),
        Seq(SamplingParams(temperature=0.0), 5, [4]),
        Seq(SamplingParams(temperature=0.0, repetition_penalty=1.8), 9, [7, 7, 8, 30]),
    ]  # fmt: skip
    sampler = TorchSampler(seed=0)
    uploaded: list[int] = []
    upload = sampler._staging.upload
    sampler._staging.upload = lambda a: (uploaded.append(a.size), upload(a))[1]  # type: ignore[method-assign]
    per_step = []
    for step in range(30):
        # The model keeps liking the same few tokens: only the penalties move the choice.
        logits = torch.randn(3, vocab, generator=gen) * 0.1
        logits[:, :6] += 3.0
        uploaded.clear()
        got = [t for t, _ in sampler.sample(logits, reqs)]  # type: ignore[arg-type]
        per_step.append(sum(uploaded))
        want = TorchSampler(seed=0).pick(
            logits, [s.params for s in reqs], [s.seq_id for s in reqs],
            outputs=[s.output_ids for s in reqs], prompts=[s.prompt_ids for s in reqs],
        )  # fmt: skip
        assert got == want, step
        for s, t in zip(reqs, got, strict=True):
            s.output_ids.append(t)
    assert len(set(reqs[0].output_ids)) > 3  # the penalties did change the choices
    assert max(per_step[5:]) <= per_step[1] + 2  # one new token per sequence a step
    # A sequence that ends frees its row; a new one with the same id starts from zero.
    sampler.release(3)
    reqs[0].output_ids = []
    logits = torch.zeros(3, vocab)
    logits[:, 2] = 1.0
    assert sampler.sample(logits, reqs)[0][0] == TorchSampler(seed=0).pick(  # type: ignore[arg-type]
        logits[:1], [reqs[0].params], [3], outputs=[[]], prompts=[[1, 2, 3]])[0]  # fmt: skip


def test_many_sequences_grow_the_table() -> None:
    vocab = 20
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    reqs = [Seq(params, i, [i % vocab]) for i in range(40)]  # more than the first 16 rows
    for s in reqs:
        s.output_ids = [s.seq_id % vocab] * 3
    logits = torch.zeros(40, vocab)
    logits[torch.arange(40), torch.arange(40) % vocab] = 1.0  # each prefers its own token
    got = [t for t, _ in TorchSampler(seed=0).sample(logits, reqs)]  # type: ignore[arg-type]
    # Its own token was said 3 times (penalty 6 > 1): it is avoided, row by row.
    assert all(t != s.seq_id % vocab for t, s in zip(got, reqs, strict=True))
