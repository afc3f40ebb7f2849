"""In-flight prefix sharing, in-batch dedup, output reservation and lpm, on the
scheduler with the fake runner of test_scheduler.py (slot errors change its outputs)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.engine.test_scheduler import VOCAB, Harness, reference
from worker.engine.req import ReqStatus


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def prefilled(h: Harness, max_tokens: list[int]) -> int:
    """Prompt tokens the runner computed: everything but one decode input per later token."""
    return h.runner.tokens_computed - sum(m - 1 for m in max_tokens)


def test_a_request_reuses_the_prefix_of_one_still_running() -> None:
    rng = random.Random(0)
    prefix = rand(rng, 200)
    h = Harness(4000, page_size=16, max_prefill_tokens=64)
    a = h.add([*prefix, *rand(rng, 9)], max_tokens=50)
    while not a.output_ids:
        h.step()
    # A is decoding; its prompt went into the tree chunk by chunk, locked by A.
    assert h.cache.match_prefix(prefix, record=False).prefix_len == 192
    b = h.add([*prefix, *rand(rng, 7)], max_tokens=5)
    while not b.output_ids:
        h.step()
    assert a.status is ReqStatus.RUNNING and b.cached_tokens == 192  # 200 to the page
    h.run()
    assert a.output_ids == reference(a.prompt_ids, 50)
    assert b.output_ids == reference(b.prompt_ids, 5)


def test_without_inflight_sharing_the_running_prefix_is_computed_again() -> None:
    rng = random.Random(0)
    prefix = rand(rng, 200)
    h = Harness(4000, max_prefill_tokens=64, share_inflight_prefixes=False)
    a = h.add([*prefix, 1], max_tokens=50)
    while not a.output_ids:
        h.step()
    b = h.add([*prefix, 2], max_tokens=5)
    while not b.output_ids:
        h.step()
    assert b.cached_tokens == 0 and a.status is ReqStatus.RUNNING


@pytest.mark.parametrize("dedup", [32, 0])
def test_a_burst_sharing_a_prefix_prefills_it_once(dedup: int) -> None:
    rng = random.Random(1)
    prefix, suffix, chunk = rand(rng, 2000), 20, 2048
    h = Harness(
        100_000, max_prefill_tokens=chunk, max_running_requests=32, inbatch_dedup_min_tokens=dedup
    )
    reqs = [h.add([*prefix, *rand(rng, suffix)], max_tokens=4) for _ in range(16)]
    h.run()
    assert all(s.output_ids == reference(s.prompt_ids, 4) for s in reqs)
    ideal = 2000 + 16 * suffix
    if dedup:
        assert prefilled(h, [4] * 16) <= ideal + chunk
        assert sum(s.cached_tokens or 0 for s in reqs) >= 15 * 2000
    else:  # the second request fits in the first step's leftover budget: 2 x the prefix
        assert prefilled(h, [4] * 16) > ideal + 1500


def test_output_reservation_decays_and_resets_after_a_preemption() -> None:
    h = Harness(4000, init_new_token_ratio=0.5, min_new_token_ratio=0.1)
    adm = h.sched.admission
    req = h.add([1, 2, 3], max_tokens=101)
    assert adm.reserve(req) == 51  # ceil(101 x 0.5)
    for _ in range(10):
        h.step()
    assert adm.new_token_ratio < 0.5
    adm.after_decode(preempted=True, decoded=True)
    assert adm.new_token_ratio == 0.5


def test_reservation_keeps_preemption_rare() -> None:
    def run(ratio: float) -> int:
        rng = random.Random(3)
        h = Harness(
            400,
            max_running_requests=16,
            init_new_token_ratio=ratio,
            min_new_token_ratio=min(ratio, 0.098),
        )
        reqs = [h.add(rand(rng, 20), max_tokens=60) for _ in range(16)]
        h.run()
        assert all(s.output_ids == reference(s.prompt_ids, 60) for s in reqs)
        return h.sched.num_preemptions

    # Reserving nothing admits all 16 (16 x 20 prompts fit) and preempts as outputs grow.
    assert run(0.7) < run(0.0)


def test_lpm_serves_the_cached_prefix_first_and_ages_the_rest() -> None:
    rng = random.Random(4)
    hot = rand(rng, 64)
    h = Harness(4000, schedule_policy="lpm", max_running_requests=1, max_queue_wait_steps=50)
    h.add([*hot, 1], max_tokens=2)
    h.run()  # `hot` is in the tree
    cold = h.add(rand(rng, 65), max_tokens=2)
    warm = h.add([*hot, 2], max_tokens=2)
    h.step()
    assert h.sched.running == [warm]  # queued after `cold`, admitted first
    h.run()
    assert cold.output_ids and warm.cached_tokens == 64

    # Age bound: a cold request that waited max_queue_wait_steps goes ahead of hits.
    blocker = h.add(rand(rng, 5), max_tokens=60)
    h.step()
    cold = h.add(rand(rng, 65), max_tokens=2)
    warm = h.add([*hot, 3], max_tokens=2)
    while blocker.status is ReqStatus.RUNNING:
        h.step()
    h.step()
    assert h.sched.running == [cold]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    policy=st.sampled_from(["fcfs", "lpm"]),
    share=st.booleans(),
    page=st.sampled_from([1, 4]),
)
def test_property_mixed_load_keeps_integrity_every_step(
    seed: int, policy: str, share: bool, page: int
) -> None:
    """Arrivals, chunked prefills, aborts and preemptions (a pool too small for the
    load); `check_integrity()` runs after every step (Harness.step) and every abort."""
    rng = random.Random(seed)
    stems = [rand(rng, rng.randrange(8, 40)) for _ in range(3)]
    h = Harness(
        rng.randrange(100, 220),
        page_size=page,
        max_prefill_tokens=rng.randrange(8, 48),
        max_running_requests=rng.randrange(2, 10),
        evict_batch_tokens=rng.randrange(1, 32),
        schedule_policy=policy,
        share_inflight_prefixes=share,
        inbatch_dedup_min_tokens=rng.choice([0, 8]),
        init_new_token_ratio=rng.choice([0.0, 0.7]),
        min_new_token_ratio=0.0,
    )
    reqs = h.drive_random(
        rng, stems, steps=300, arrive_until=120, p_arrive=0.35, p_abort=0.04, max_suffix=16,
        max_tokens=30,
    )  # fmt: skip
    released = set(h.runner.released)
    assert all(
        s.seq_id in released for s in reqs if s.num_tokens > 0 and s.cached_tokens is not None
    )
    h.cache.reset()
    assert h.allocator.available == h.allocator.capacity
