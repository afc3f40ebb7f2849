"""Overlap scheduling (engine.py): step N+1 is scheduled and launched before step N's
draws are read, with step N's tokens as placeholders the device resolves
(futures.py). Greedy outputs must be exactly those of the in-order engine, whatever
arrives, is aborted or preempted meanwhile; the engine's invariants hold after every
step. On CPU the forward is not asynchronous, so these tests show the order and the
bookkeeping are right, not that anything runs concurrently."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.futures import FutureTokens
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams

# A pool far smaller than the work, and admission that reserves nothing for outputs:
# running requests outgrow it and the newest are preempted, then readmitted.
TIGHT = dict(
    kv_capacity_tokens=200, max_running_requests=8, max_prefill_tokens=24,
    init_new_token_ratio=0.0, min_new_token_ratio=0.0, device="cpu",
)  # fmt: skip


def _script(seed: int) -> tuple[dict[int, list[EngineRequest]], dict[int, list[str]]]:
    """Arrivals and aborts by step number: greedy requests, some with stop ids, n=2
    and logprobs, one with penalties (the engine reads the step before it in order)."""
    rng = random.Random(seed)
    arrivals: dict[int, list[EngineRequest]] = defaultdict(list)
    aborts: dict[int, list[str]] = defaultdict(list)
    for i in range(14):
        prompt = [rng.randrange(4, 1000) for _ in range(rng.randrange(8, 48))]
        params = SamplingParams(
            max_tokens=rng.randrange(6, 40), temperature=0,
            # ~8% of the vocabulary: some of these end on a stop id, mid-stream.
            stop_token_ids=tuple(rng.sample(range(4, 1000), 80)) if i % 3 == 0 else (),
            n=2 if i % 5 == 1 else 1, logprobs=i % 4 == 2, top_logprobs=2 if i % 4 == 2 else 0,
            presence_penalty=0.5 if i == 7 else 0.0, ignore_eos=True,
        )  # fmt: skip
        arrivals[rng.randrange(0, 30)].append(EngineRequest(f"r{i}", prompt_token_ids=prompt,
                                                            params=params))  # fmt: skip
        if i % 6 == 4:
            aborts[rng.randrange(5, 40)].append(f"r{i}")
    return arrivals, aborts


def _drive(engine: LLMEngine, seed: int) -> tuple[dict, set[str], int]:
    """Run the script; each choice's tokens and finish reason, the aborted ids, and how
    many decode items ran on a placeholder."""
    arrivals, aborts = _script(seed)
    tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
    reasons: dict[tuple[str, int], str | None] = {}
    aborted: set[str] = set()
    on_placeholder = 0
    for step in range(3000):
        for request in arrivals.get(step, ()):
            engine.add_request(request)
        for rid in aborts.get(step, ()):
            if rid in engine.in_flight:
                aborted.add(rid)
            for out in engine.abort(rid):
                tokens[(rid, out.index)] += out.token_ids
                reasons[(rid, out.index)] = out.finish_reason
        if not engine.has_work and step > max(arrivals):
            break
        for out in engine.step():
            tokens[(out.request_id, out.index)] += out.token_ids
            reasons[(out.request_id, out.index)] = out.finish_reason
        on_placeholder += sum(min(it.input_ids) < 0 for it in engine.last_batch.items)
        engine.check_integrity()
    else:
        raise AssertionError("the engine did not finish")
    assert not engine.in_flight
    assert engine.allocator.available + engine.cache.total_size == engine.allocator.capacity
    return {k: (tokens[k], reasons[k]) for k in reasons}, aborted, on_placeholder


@pytest.mark.parametrize("seed", [0])
def test_greedy_outputs_equal_with_overlap_on_and_off(tiny_model_dir: Path, seed: int) -> None:
    on = load_engine(tiny_model_dir, EngineConfig(**TIGHT))  # type: ignore[arg-type]
    off = load_engine(
        tiny_model_dir,
        EngineConfig(**TIGHT, overlap_schedule=False),  # type: ignore[arg-type]
    )
    assert on.overlap and not off.overlap
    got_on, aborted_on, placeholders_on = _drive(on, seed)
    got_off, aborted_off, placeholders_off = _drive(off, seed)
    assert placeholders_off == 0 and placeholders_on > 50  # step N+1 ran on N's futures
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    assert got_on.keys() == got_off.keys()
    reasons = {r for _, r in got_off.values()}
    assert {"length", "stop"} <= reasons
    for key, (ids_off, reason_off) in got_off.items():
        ids_on, reason_on = got_on[key]
        if key[0] in aborted_on | aborted_off:
            # Aborted at the same step, the overlapped engine has read one step fewer.
            short, long = sorted((ids_on, ids_off), key=len)
            assert long[: len(short)] == short, key
            continue
        assert (ids_on, reason_on) == (ids_off, reason_off), key
    assert aborted_on and all(got_off[k][1] == "abort" for k in got_off if k[0] in aborted_on)


def test_overlap_flag_off_and_sim_runner_run_in_order(tiny_model_dir: Path) -> None:
    """`overlap_schedule=False` (the `--disable-overlap-schedule` flag) reads every step
    before the next is scheduled; a step's outputs are its own."""
    engine = load_engine(
        tiny_model_dir, EngineConfig(device="cpu", kv_capacity_tokens=512, overlap_schedule=False)
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("a", prompt_token_ids=[5, 6, 7], params=params))
    counts = [len(engine.step()) for _ in range(3)]
    assert counts == [1, 1, 1] and not engine.has_work


def test_overlapped_step_outputs_lag_one_step(tiny_model_dir: Path) -> None:
    """With overlap, a step hands out the previous step's tokens; a finished request
    runs once more (its draw dropped) and the engine ends with nothing held."""
    engine = load_engine(tiny_model_dir, EngineConfig(device="cpu",
                                                                  kv_capacity_tokens=512))  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("a", prompt_token_ids=[5, 6, 7], params=params))
    outs = []
    for _ in range(10):
        if not engine.has_work:
            break
        outs.append(engine.step())
        engine.check_integrity()
    # Prefill, decode, decode, the lagged decode (its draw dropped), read the last.
    assert [len(o) for o in outs] == [0, 1, 1, 1, 0]
    assert outs[3][0].finished and outs[3][0].completion_tokens == 3
    assert [len(o[0].token_ids) for o in outs[1:4]] == [1, 1, 1]


def test_future_ring_resolves_placeholders_on_the_device() -> None:
    futures = FutureTokens(max_per_step=4, device=torch.device("cpu"))
    start = futures.take(3)
    futures.publish(start, torch.tensor([11, 12, 13]))
    ids = torch.tensor([7, -(start + 1), -(start + 3), 9])
    assert futures.resolve(ids).tolist() == [7, 11, 13, 9]
    # Blocks never straddle the ring's end: a block that would not fit starts at 0.
    assert futures.take(4) == 3 and futures.take(4) == 0
    with pytest.raises(ValueError, match="ring holds"):
        futures.take(5)
