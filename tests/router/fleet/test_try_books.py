"""A try's books, fused for the proxy's common exit (router/fleet/table.py
`Fleet.succeeded(..., release=True)`, and `Fleet.attempt` filling its `Attempt` itself):
the same figures as the steps they fuse (`succeeded`, then `attempt.release()`), on two
real worker tables driven in lockstep through random tries: successes with and without
cached tokens and calibration, failures that open breakers, half-open probes, tries
abandoned without a verdict, other replicas' loads, and the view the policy reads."""

from __future__ import annotations

import random
from typing import Any

import pytest

from router.fleet.table import Attempt, Fleet
from router.fleet.workers import FailureKind
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord

WORKERS = ("w0", "w1", "w2")


class Hooks:
    """The holdings room's side: every call the table makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def forget(self, worker_id: str) -> None:
        self.calls.append(("forget", worker_id))

    def answered(self, *args: object) -> None:
        self.calls.append(("answered", *args))


def _fleet(remote: dict[str, dict[str, int]]) -> tuple[Fleet, Hooks]:
    """A table of three workers; `remote["now"]`: other replicas' loads (replaced, never
    edited: the table reads a new mapping as news)."""
    config = RouterConfig.model_validate({"breaker_failures": 2, "breaker_cooldown": 5.0})
    hooks = Hooks()
    fleet = Fleet(config, hooks, lambda: remote["now"])  # type: ignore[arg-type]
    fleet.apply_registry(
        {
            wid: WorkerRecord(
                wid, f"http://127.0.0.1:{9000 + i}", "m", "sim", 1.0, running=i, waiting=0
            )
            for i, wid in enumerate(WORKERS)
        }
    )
    return fleet, hooks


def _figures(fleet: Fleet, hooks: Hooks, now: float) -> dict[str, Any]:
    """Every figure a try's books write, and what the policy reads of them."""
    view = fleet.view(now)
    return {
        "workers": {
            wid: (
                w.in_flight,
                w.requests_total,
                w.failures_total,
                w.predicted_tokens_total,
                w.actual_cached_tokens_total,
                w.chars_per_token,
                w.calibration_rejected_total,
                w.breaker.failures,
                w.breaker.opened_at,
                w.breaker.probing,
            )
            for wid, w in fleet.workers.items()
        },
        "view": (list(view.ids), list(view.loads)),
        "generation": fleet.columns._generation,
        "holdings": list(hooks.calls),
    }


@pytest.mark.parametrize("seed", range(12))
def test_a_fused_success_keeps_the_books_of_succeeded_then_release(seed: int) -> None:
    rng = random.Random(seed)
    remote = {"now": {"w1": 2}}
    fused, fused_hooks = _fleet(remote)
    steps, steps_hooks = _fleet(remote)
    # Open tries, the same on both tables: (fused table's attempt, the other's).
    held: list[tuple[Attempt, Attempt]] = []
    now = 0.0
    for _ in range(400):
        now += rng.choice((0.0, 0.5, 3.0))
        action = rng.random()
        routable = fused.view(now).ids
        assert list(routable) == list(steps.view(now).ids)
        if action < 0.45 and routable:
            wid = rng.choice(list(routable))
            pair = (fused.attempt(fused.workers[wid], now), steps.attempt(steps.workers[wid], now))
            assert pair[0].probe == pair[1].probe
            held.append(pair)
        elif action < 0.75 and held:
            a, b = held.pop(rng.randrange(len(held)))
            predicted = rng.choice((0.0, 12.5, 300.0))
            cached = rng.choice((None, 0, 10, 400))
            chars, tokens = rng.choice(((0, None), (500, 100.0), (800, 3.0), (90, 0.0)))
            fused.succeeded(a, predicted, cached, chars, tokens, now, release=True)
            assert a.released
            a.release()  # the proxy's `finally` finds it released: nothing moves
            steps.succeeded(b, predicted, cached, chars, tokens, now)
            assert not b.released  # without `release`, the try is still held (a stream's)
            b.release()
        elif action < 0.9 and held:
            a, b = held.pop(rng.randrange(len(held)))
            kind = rng.choice((FailureKind.CONNECT, FailureKind.BROKEN, FailureKind.BUSY))
            for fleet, attempt in ((fused, a), (steps, b)):
                fleet.failed(attempt, kind, now)
                attempt.release()
        elif held:  # ended without a verdict (the client left): a probe is abandoned
            a, b = held.pop(rng.randrange(len(held)))
            a.release()
            b.release()
        if rng.random() < 0.05:  # another replica's load moved
            remote["now"] = {"w1": rng.randrange(4), "w2": rng.randrange(3)}
        assert _figures(fused, fused_hooks, now) == _figures(steps, steps_hooks, now)
    assert any(w.breaker.opened_at is not None or w.failures_total for w in fused.workers.values())


def test_a_fused_release_frees_a_probe_and_a_second_release_changes_nothing() -> None:
    fleet, _ = _fleet({"now": {}})
    worker = fleet.workers["w0"]
    for t in (0.0, 0.1):  # two failures open the breaker (breaker_failures 2)
        with fleet.attempt(worker, t) as attempt:
            fleet.failed(attempt, FailureKind.CONNECT, t)
    assert worker.breaker.opened_at is not None
    probe = fleet.attempt(worker, 6.0)  # past the 5 s cooldown: the half-open probe
    assert probe.probe and worker.breaker.probing and worker.in_flight == 1
    assert "w0" not in fleet.view(6.0).ids  # a probing worker takes nothing else
    fleet.succeeded(probe, 0.0, None, 0, None, 6.0, release=True)
    assert (worker.in_flight, worker.breaker.probing, worker.breaker.opened_at) == (0, False, None)
    assert "w0" in fleet.view(6.0).ids
    probe.release()
    fleet.succeeded(probe, 0.0, None, 0, None, 6.0, release=True)  # released already
    assert worker.in_flight == 0 and worker.requests_total == 3
