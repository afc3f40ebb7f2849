"""cost_aware over numpy columns makes exactly the decisions of the per-worker Python it
replaced (frozen in tests/router/cost_aware_reference.py).

Both replay one random stream with the same seeded randomness: requests sharing
prefixes of random lengths, loads across the seat limits, heartbeats (unknown, garbage
and repeated figures among them), other replicas' observations, new epochs, workers
leaving and rejoining the view and retries' one-off views. Figures come from small
sets so that prices tie often: the tie rule and the hold margin are exercised (counted
below), not just the plain minimum. Every decision must agree: worker, reason, match.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from router.holdings.room import Holdings
from router.policy.base import Decision, FleetView, RouteRequest, WorkerView
from router.policy.cost_aware import CostAware
from router.routing import Routing
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord
from tests.router.cost_aware_reference import CostAwareReference, costs_of


class CountingRandom(random.Random):
    def choice(self, seq: Any) -> Any:  # type: ignore[override]
        self.draws = getattr(self, "draws", 0) + 1
        return super().choice(seq)


class CountingReference(CostAwareReference):
    """The reference, counting how often its tie and hold branches decided."""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.seen: Counter[str] = Counter()

    def _pick(self, cost: list[float], matched: dict[int, int], loads: list[int]) -> int:
        if cost.count(min(cost)) > 1:
            self.seen["tie"] += 1
        return super()._pick(cost, matched, loads)

    def _hold(self, i: int, cost: list[float], matched: dict[int, int], longest: int) -> int:
        held = super()._hold(i, cost, matched, longest)
        self.seen["held" if held != i else "not held"] += 1
        return held


def heartbeat(rng: random.Random, w: str) -> WorkerRecord:
    if rng.random() < 0.05:  # garbage from Redis: counts as unknown
        return WorkerRecord(
            w, "http://w", "m", "sim", 1.0, queued_prefill_tokens=-3,
            prefill_us_per_token=float("nan"), decode_ms_per_token=float("inf"),
            max_running_requests=-1, request_ms=1e12, prompt_tokens_total=1, cached_tokens_total=7,
        )  # fmt: skip
    prompt = rng.choice((0, 1_000, 1_000_000))
    return WorkerRecord(
        w, "http://w", "m", "sim", 1.0,
        queued_prefill_tokens=rng.choice((0, 0, 40, 400, 4_000)),
        prefill_us_per_token=rng.choice((0.0, 20.0, 30.0, 1_000.0)),
        decode_ms_per_token=rng.choice((0.0, 1.0, 3.0)),
        max_running_requests=rng.choice((0, 4, 8)),
        request_ms=rng.choice((0.0, 40.0, 80.0)),
        prompt_tokens_total=prompt,
        cached_tokens_total=rng.choice((0, 0, prompt // 2, rng.randrange(prompt + 1))),
    )  # fmt: skip


class Heartbeats:
    """The table's side of the stream: each worker's last heartbeat and when it was read.
    The reference takes it as ``set_costs`` and stamps it at its next ``select``; the view
    carries it stamped with that same instant (``read`` before each select)."""

    def __init__(self, ref: CostAwareReference) -> None:
        self.ref = ref
        self.records: dict[str, WorkerRecord] = {}
        self.at: dict[str, float] = {}
        self.unread: set[str] = set()

    def beat(self, record: WorkerRecord) -> None:
        w = record.worker_id
        self.ref.set_costs(w, costs_of(record))
        self.records[w] = replace(record)  # a heartbeat is a new object, same figures or not
        self.unread.add(w)

    def forget(self, w: str) -> None:  # a new epoch: no report until its next heartbeat
        self.records.pop(w, None)
        self.at.pop(w, None)
        self.unread.discard(w)

    def read(self, now: float) -> None:
        for w in self.unread:
            self.at[w] = now
        self.unread.clear()

    def write(self, view: FleetView) -> None:
        """Into the kept view, in place, as the table does."""
        for i, w in enumerate(view.ids):
            record, at = self.records.get(w), self.at.get(w, 0.0)
            if view.reports[i] is not record or view.reported_at[i] != at:
                view.reports[i], view.reported_at[i] = record, at
                view.reported += 1


def replay(n: int, seed: int, keys: dict[str, Any], steps: int) -> Counter[str]:
    """Both policies through one stream; asserts every decision agrees."""
    config = RouterConfig(policy="cost_aware", **keys)
    draws = CountingRandom(seed)
    ref = CountingReference(config, draws)
    new = Routing(Holdings(config), CostAware(config, random.Random(seed)))
    beats = Heartbeats(ref)
    rng = random.Random(seed + 1)
    every = [f"w{i}" for i in range(n)]
    caps = {w: rng.choice((0, 0, 60, 200)) for w in every}
    loads = {w: 0 for w in every}
    out = set(rng.sample(every, n // 8))  # not routable (draining, breaker open) for now
    systems = ["".join(rng.choices("ab", k=160)) for _ in range(6)]
    for w in every:
        if rng.random() < 0.8:
            beats.beat(heartbeat(rng, w))
    view = None
    now = 0.0
    for _ in range(steps):
        now += rng.choice((0.0, 0.001, 0.004, 0.02, 0.1))
        for _ in range(rng.randint(0, 3)):
            w = rng.choice(every)
            loads[w] = rng.choice((0, 1, 3, 4, 5, 8, 9, 12))
        for _ in range(rng.choice((0, 0, 1, 3))):
            record = heartbeat(rng, rng.choice(every))
            beats.beat(record)
            if rng.random() < 0.3:
                beats.beat(record)  # the same figures again: a fresh stamp only
        quiet = rng.random() < 0.02  # all idle, all reporting the same figures, a new text
        if quiet:
            record = heartbeat(rng, "")
            loads = dict.fromkeys(every, 0)
            for w in every:
                beats.beat(replace(record, worker_id=w))
        if rng.random() < 0.05:
            w, text = rng.choice(every), rng.choice(systems)[: rng.randrange(4, 160, 4)]
            ref.observe(w, text, now)
            new.holdings.observe(w, text, now)
        if rng.random() < 0.02:  # other replicas spread a hot prefix over half the fleet
            text = rng.choice(systems)[: rng.randrange(40, 160, 4)]
            for w in rng.sample(every, n // 2):
                ref.observe(w, text, now)
                new.holdings.observe(w, text, now)
        if rng.random() < 0.01:
            w = rng.choice(every)
            ref.remove_worker(w)  # a new epoch: its tree, reports and own queue go
            new.holdings.forget(w)
            beats.forget(w)
        w = rng.choice(every)
        if rng.random() < 0.03 and (w in out or len(out) < max(1, n // 4)):
            out ^= {w}  # a worker leaves or rejoins the routable set
            view = None
        ids = [w for w in every if w not in out]
        if view is None or rng.random() < 0.02:  # also: a retry's one-off view
            view = FleetView(ids, [0] * len(ids), [caps[w] for w in ids])
        view.loads[:] = [loads[w] for w in ids]
        beats.read(now)
        beats.write(view)
        workers: Sequence[WorkerView] = view
        if rng.random() >= 0.8:
            workers = [
                WorkerView(w, loads[w], caps[w], beats.records.get(w), beats.at.get(w, 0.0))
                for w in ids
            ]
        if rng.random() < 0.02:
            text = ""
        elif quiet:
            text = "".join(rng.choices("xyz", k=rng.randrange(4, 400, 4)))
        else:
            text = rng.choice(systems)[: rng.randrange(0, 160, 4)]
            text += "".join(rng.choices("abc", k=rng.randrange(4, 48, 4)))
        want: Decision = ref.select(RouteRequest(text), workers, now)
        got = new.select(RouteRequest(text), workers, now)
        assert got == want, (n, seed, keys, ref.seen)
        ref.seen[want.reason] += 1
        assert type(got.matched_chars) is int and type(got.match_rate) is float
    assert new.policy._own == ref._own
    ref.seen["random"] = getattr(draws, "draws", 0)
    return ref.seen


CONFIGS = [
    {},
    {"cost_hold_margin": 0.0},
    {"cost_stall_weight": 0.0, "cost_miss_weight": 2.0, "cost_decode_weight": 0.0},
    {"tree_chars_per_token": 2.5, "cost_hold_margin": 2.0},
]


@pytest.mark.parametrize("keys", CONFIGS)
@pytest.mark.parametrize("n", [4, 14, 64, 256])  # 14: 11–14 routable (lists priced apart once)
def test_numpy_columns_make_every_decision_the_reference_made(n: int, keys: dict[str, Any]) -> None:
    seen = replay(
        n, seed=n * 7 + len(keys), keys=keys, steps={4: 1_500, 14: 1_000, 64: 800, 256: 400}[n]
    )
    # The stream reached the branches where exactness is hardest: tied prices (by the
    # longer match, the lower load, then the shared random draw) and the hold margin.
    assert (
        seen["tie"] and seen["random"] and seen["cache_hit"] and seen["spill"] and seen["no_match"]
    )
    if keys.get("cost_hold_margin", 1.0):
        assert seen["held"] > 0 and seen["not held"] > 0
