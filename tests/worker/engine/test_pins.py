"""Pins across tool gaps (worker/engine/pins.py) over the real scheduler and radix cache,
with the fake runner of test_scheduler.py: a pinned session prefix survives the traffic
that LRU would evict it for, is released by its TTL, by the session's next call, by the
budget (oldest first) and by memory pressure (to the host tier where there is one), and
`check_integrity` (every lock accounted to a running request or a pin) holds at each step.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.engine.test_host_tier import HostHarness
from tests.worker.engine.test_scheduler import VOCAB, Harness, reference
from worker.engine.allocator import SlotAllocator
from worker.engine.config import EngineConfig
from worker.engine.hiradix_cache import HiRadixCache
from worker.engine.host_tier import HostTier
from worker.engine.pins import PinTable
from worker.engine.req import Req


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def with_pins(h: Harness, budget: int, max_ttl: float = 60.0) -> Clock:
    clock = Clock()
    h.sched.pins = PinTable(h.cache, budget, max_ttl, clock)  # type: ignore[arg-type]
    return clock


def session_call(h: Harness, prompt: list[int], key: str, ttl: float, max_tokens: int = 4) -> Req:
    req = h.add(prompt, max_tokens)
    req.pin_key, req.pin_ttl = key, ttl
    return req


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def tool_gap_hit(pin_ttl: float) -> int:
    """An agent call, a gap filled by other traffic that needs the whole pool, the next call."""
    rng = random.Random(3)
    h = Harness(128, max_prefill_tokens=128, evict_batch_tokens=8)
    with_pins(h, budget=64)
    prompt = _rand(rng, 40)
    first = session_call(h, prompt, "agent-1", pin_ttl)
    h.run()
    for _ in range(6):  # 6 x 44 tokens through a 128-slot pool: LRU evicts the session
        h.add(_rand(rng, 40), 4)
        h.run()
    nxt = session_call(h, prompt + first.output_ids + _rand(rng, 10), "agent-1", pin_ttl)
    h.run()
    assert nxt.output_ids == reference(nxt.prompt_ids, 4)
    return nxt.cached_tokens or 0


def test_a_pinned_prefix_survives_the_tool_gap_that_lru_evicts() -> None:
    assert tool_gap_hit(pin_ttl=0) == 0  # plain LRU: gone
    assert tool_gap_hit(pin_ttl=30) == 43  # prompt + 3 computed answer tokens


def test_the_next_call_releases_the_pin_and_pins_anew() -> None:
    h = Harness(256)
    with_pins(h, budget=200)
    pins = h.sched.pins
    assert pins is not None
    a = session_call(h, list(range(1, 31)), "s", 10)
    h.run()
    assert len(pins) == 1 and pins.pinned_tokens == 33
    b = session_call(h, a.prompt_ids + a.output_ids + [5, 6], "s", 10)
    h.step()  # admitted: its own lock holds the path now
    assert pins.released["next_call"] == 1 and len(pins) == 0
    h.run()
    assert len(pins) == 1 and pins.pinned_tokens == len(b.prompt_ids) + 3


def test_a_pin_expires_after_its_ttl() -> None:
    h = Harness(256)
    clock = with_pins(h, budget=200)
    pins = h.sched.pins
    assert pins is not None
    session_call(h, list(range(1, 31)), "s", 10)
    h.run()
    assert h.cache.evictable_size == 0
    clock.now = 10.5
    h.add([90, 91], 1)
    h.run()  # schedule() expires it
    assert len(pins) == 0 and pins.released["expired"] == 1
    assert h.cache.evictable_size >= 33  # evictable again


def test_past_the_budget_the_oldest_pin_goes_first() -> None:
    h = Harness(512)
    with_pins(h, budget=100)
    pins = h.sched.pins
    assert pins is not None
    for i in range(3):
        session_call(h, [i + 1] * 40, f"s{i}", 10)
        h.run()
    assert list(pins._pins) == ["s1", "s2"] and pins.released["budget"] == 1
    assert pins.pinned_tokens == 86 <= pins.budget


def test_pins_give_way_under_memory_pressure() -> None:
    """Pins hold 3/4 of the pool; a request that needs it still runs (pins never starve
    other traffic): the oldest pins are released, not the request refused."""
    h = Harness(128, max_prefill_tokens=128)
    with_pins(h, budget=128)
    pins = h.sched.pins
    assert pins is not None
    for i in range(2):
        session_call(h, [i + 1] * 44, f"s{i}", 60)
        h.run()
    assert pins.pinned_tokens == 94
    big = h.add(_rand(random.Random(4), 100), 4)
    h.run()
    assert big.output_ids == reference(big.prompt_ids, 4)
    assert pins.released["pressure"] >= 1


def test_under_pressure_a_pinned_prefix_moves_to_the_host_tier() -> None:
    h = HostHarness(128, 256, max_prefill_tokens=128)
    with_pins(h, budget=128)
    pins = h.sched.pins
    assert pins is not None
    a = session_call(h, [7] * 60, "s", 60)
    h.run()
    big = h.add(_rand(random.Random(5), 100), 4)
    h.run()
    assert pins.released["pressure"] == 1
    match = h.cache.match_prefix(a.prompt_ids, record=False)
    assert match.prefix_len + match.host_len == 60 and match.host_len > 0
    assert big.output_ids == reference(big.prompt_ids, 4)


def test_a_pin_is_released_to_the_host_lru_not_dropped_first() -> None:
    """Cache units: relieve() unlocks, eviction then writes the prefix back to the host."""
    alloc = SlotAllocator(32)
    cache = HiRadixCache(alloc, HostTier(64))
    cache.insert(list(range(1, 17)), alloc.alloc(16))
    pins = PinTable(cache, budget=32, max_ttl=60, clock=Clock())
    assert pins.pin("s", list(range(1, 17)), 30) == 16
    assert cache.evict(16) == 0  # pinned: the LRU skips it
    assert pins.relieve(16) == 1 and cache.evict(16) == 16
    cache.take_copies()
    assert cache.match_prefix(list(range(1, 17)), record=False).host_len == 16
    pins.check()
    cache.check_integrity()


def test_the_ttl_is_clamped_to_the_maximum() -> None:
    pins = PinTable(HiRadixCache(SlotAllocator(8), HostTier(8)), 8, max_ttl=120)
    assert pins.grant(600) == (120, True) and pins.grant(30) == (30, False)
    assert pins.clamped == 1


@pytest.mark.parametrize("budget", [-0.1, 1.5])
def test_a_pin_budget_outside_zero_one_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="pin_budget"):
        EngineConfig(pin_budget=budget)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    capacity=st.sampled_from([96, 160, 256]),
    budget=st.integers(0, 200),
    host=st.sampled_from([0, 200]),
)
def test_random_sessions_keep_every_invariant(
    seed: int, capacity: int, budget: int, host: int
) -> None:
    """Sessions (some pinned), unkeyed traffic, aborts and a moving clock; after every
    step `check_integrity` accounts each lock to a running request or a pin, pins stay
    within the budget, and every answer equals the reference."""
    rng = random.Random(seed)
    h = HostHarness(capacity, host, max_prefill_tokens=64, evict_batch_tokens=8)
    clock = with_pins(h, budget=budget, max_ttl=20)
    sessions: dict[str, list[int]] = {}
    reqs: list[Req] = []
    aborted: set[int] = set()
    for _ in range(120):
        clock.now += rng.choice([0.0, 0.5, 3.0])
        if rng.random() < 0.35:
            key = f"s{rng.randrange(4)}"
            prompt = sessions.get(key, _rand(rng, rng.randrange(5, 30)))
            prompt = (prompt + _rand(rng, rng.randrange(1, 8)))[-60:]
            sessions[key] = prompt
            reqs.append(session_call(h, prompt, key, rng.choice([0, 5, 15]), rng.randrange(1, 5)))
        elif rng.random() < 0.2:
            reqs.append(h.add(_rand(rng, rng.randrange(5, 40)), rng.randrange(1, 5)))
        live = [r for r in reqs if not r.is_finished]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            h.sched.abort(victim)
            aborted.add(victim.seq_id)
            h.sched.check_integrity()
        if h.sched.has_work:
            h.step()
    h.run()
    for req in reqs:
        if req.seq_id not in aborted:
            assert req.output_ids == reference(req.prompt_ids, req.params.max_tokens)


@pytest.mark.parametrize("budget", ["-0.5", "1.5"])
def test_a_worker_with_a_pin_budget_outside_zero_one_refuses_to_start(budget: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "serve", "--engine", "sim", "--port", "1",
         "--pin-budget", budget],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "pin_budget" in proc.stderr
