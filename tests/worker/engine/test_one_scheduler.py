"""The engine on the tiny model and on the sim cost model: one scheduler for both, and
the A/B case of in-flight sharing with real KV (outputs identical with and without
the cache)."""

from __future__ import annotations

import random
from pathlib import Path

from shared.tokens.text_tokenizer import TextTokenizer
from tests.worker.engine.test_engine import make_engine, rand_ids, req, run, tokens
from worker.backends.sim import build_sim_llm_engine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine


def test_b_hits_the_prefix_of_a_while_a_still_decodes(tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    prefix = rand_ids(rng, 300)
    a = req("a", [*prefix, *rand_ids(rng, 9)], max_tokens=40)
    b = req("b", [*prefix, *rand_ids(rng, 7)], max_tokens=6)
    engine = make_engine(tiny_model_dir, page_size=16, max_prefill_tokens=128)
    outs: dict[str, list] = {"a": [], "b": []}
    engine.add_request(a)
    while not outs["a"]:
        for out in engine.step():
            outs[out.request_id].append(out)
        engine.check_integrity()
    engine.add_request(b)
    while not outs["b"]:
        for out in engine.step():
            outs[out.request_id].append(out)
        engine.check_integrity()
    assert not outs["a"][-1].finished  # A is still decoding
    assert outs["b"][0].cached_tokens >= 300 - 300 % 16
    for rid, more in run(engine).items():
        outs[rid] += more
    plain = run(make_engine(tiny_model_dir, disable_radix_cache=True), a, b)
    assert tokens(outs["a"]) == tokens(plain["a"]) and len(tokens(outs["a"])) == 40
    assert tokens(outs["b"]) == tokens(plain["b"])


def _decisions(engine: LLMEngine, arrivals: dict[int, list]) -> list[list[tuple]]:
    """Per step: (request, start_pos, tokens run, sampled) of every item, and preemptions."""
    steps = []
    for step in range(10_000):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        if not engine.has_work and step > max(arrivals):
            return steps
        engine.step()
        engine.check_integrity()
        batch = engine.last_batch
        items = [
            (s.request_id, i.start_pos, len(i.input_ids), i.sample)
            for s, i in zip(batch.reqs, batch.items, strict=True)
        ]
        steps.append([*items, *(("preempted", s.request_id) for s in batch.preempted)])
    raise AssertionError("did not finish")


def test_sim_and_radix_make_the_same_scheduling_decisions(tiny_model_dir: Path) -> None:
    rng = random.Random(5)
    stems = [rand_ids(rng, 60), rand_ids(rng, 90)]
    arrivals: dict[int, list] = {}
    for i in range(14):
        prompt = [*rng.choice(stems), *rand_ids(rng, rng.randrange(3, 40))]
        arrivals.setdefault(rng.randrange(0, 30), []).append(
            req(f"r{i}", prompt, max_tokens=rng.randrange(20, 60))
        )
    # A pool too small for the load and no output reservation: eviction and preemption.
    cfg = dict(
        kv_capacity_tokens=200,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        max_prefill_tokens=64,
        max_running_requests=8,
        page_size=4,
        evict_batch_tokens=16,
        schedule_policy="lpm",
        device="cpu",
    )
    # The sim runs in order (no futures); so must the model's engine to decide alike.
    radix = make_engine(tiny_model_dir, **cfg, overlap_schedule=False)
    sim = build_sim_llm_engine(EngineConfig(**cfg), TextTokenizer(), sleep=None)  # type: ignore[arg-type]
    assert sim.scheduler.__class__ is radix.scheduler.__class__
    got_radix, got_sim = _decisions(radix, arrivals), _decisions(sim, arrivals)
    assert got_radix == got_sim
    assert radix.stats().preemptions_total == sim.stats().preemptions_total > 0
    assert radix.stats().cached_tokens_total == sim.stats().cached_tokens_total > 0
