"""The sampling surface, batched on the logits' device: penalties as OpenAI and vLLM
define them, logit_bias, min_p, logprobs equal to log-softmax at temperature 1, and
`n` choices sharing the prompt's KV (on the tiny model)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tests.worker.engine.test_engine import make_engine, rand_ids, req, run, tokens
from worker.engine.runtime.penalties import penalize
from worker.engine.runtime.sampler import TorchSampler
from worker.engine.types import SamplingParams


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = penalize(logits, params, [[3, 3, 7], [3]], None)
    want = logits[0].clone()
    want[3] -= 0.25 * 2 + 0.5
    want[7] -= 0.25 * 1 + 0.5
    assert torch.allclose(out[0], want) and torch.equal(out[1], logits[1])


def test_repetition_penalty_scales_seen_tokens_by_sign() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = penalize(logits, [SamplingParams(repetition_penalty=2.0)], [[1]], [[0]])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]  # 0 (prompt) and 1 (output) were seen


def test_logit_bias_and_min_p_change_the_choice() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = TorchSampler(seed=0)
    banned = SamplingParams(temperature=0, logit_bias=((0, -100.0),))
    assert sampler.pick(logits, [banned], [0]) == [1]
    forced = SamplingParams(temperature=0, logit_bias=((3, 100.0),))
    assert sampler.pick(logits, [forced], [0]) == [3]
    # min_p 0.5 keeps tokens with p >= 0.25: {0, 1}; 0.2 keeps p >= 0.1: {0, 1, 2}.
    for min_p, want in ((0.5, {0, 1}), (0.2, {0, 1, 2})):
        p = SamplingParams(min_p=min_p)
        assert {sampler.pick(logits, [p], [0])[0] for _ in range(400)} == want


def test_penalties_change_greedy_output_as_defined(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = rand_ids(random.Random(7), 12)
    plain = tokens(run(engine, req("p", prompt, max_tokens=24))["p"])
    assert len(set(plain)) < len(plain)  # the random model repeats itself greedily
    strict = req("f", prompt, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
    penalized = tokens(run(engine, strict)["f"])
    assert penalized != plain and len(set(penalized)) > len(set(plain))


def test_logprobs_are_log_softmax_of_the_logits(tiny_model_dir: Path) -> None:
    # In order, one forward per token (overlap runs one more: test_overlap.py).
    engine = make_engine(tiny_model_dir, overlap_schedule=False)
    seen: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(items):  # type: ignore[no-untyped-def]
        logits = forward(items)
        seen.append(logits.clone())
        return logits

    engine.runner.forward = recording
    r = req("lp", rand_ids(random.Random(8), 10), max_tokens=5, logprobs=True, top_logprobs=3)
    outs = run(engine, r)["lp"]
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 5 and [lp.token_id for lp in lps] == tokens(outs)
    for lp, logits in zip(lps, seen, strict=True):
        ref = logits[0].float().log_softmax(-1)
        assert abs(lp.logprob - ref[lp.token_id].item()) < 1e-5
        values, ids = ref.topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert all(abs(v - w) < 1e-5 for (_, v), w in zip(lp.top, values.tolist(), strict=True))


def test_n_choices_share_the_prompt_kv_and_count_it_once(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, overlap_schedule=False)  # counts in-order tokens
    prompt = rand_ids(random.Random(9), 80)
    outs = run(engine, req("n", prompt, max_tokens=6, n=3))["n"]
    by_choice = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
    assert by_choice[0] == by_choice[1] == by_choice[2] and len(by_choice[0]) == 6  # greedy
    # The prompt ran once; each other choice recomputed only its last prompt token.
    assert engine.runner.tokens_computed == 80 + 2 * 1 + 3 * 5
    stats = engine.stats()
    assert stats.prompt_tokens_total == 80 and stats.completion_tokens_total == 18
    sampled = run(engine, req("s", prompt, max_tokens=8, n=2, temperature=1.0, seed=3))["s"]
    a = [t for o in sampled if o.index == 0 for t in o.token_ids]
    b = [t for o in sampled if o.index == 1 for t in o.token_ids]
    assert a != b  # seed + choice index: each choice its own stream
