"""Fleet table units: breaker states, the load guard, registry sync, routable filtering."""

from __future__ import annotations

import pytest

from router.fleet import Breaker, Fleet, LoadGuard
from router.policy import RouteRequest, WorkerView, build_policy
from shared.config import RouterConfig
from shared.registry import WorkerRecord


def record(wid: str, epoch: float = 1.0, **kw: object) -> WorkerRecord:
    return WorkerRecord(wid, f"http://127.0.0.1:{9000 + int(wid[1:])}", "m", "sim", epoch, **kw)  # type: ignore[arg-type]


class Hooks:
    def __init__(self) -> None:
        self.removed: list[str] = []
        self.capacity: dict[str, int] = {}

    def remove_worker(self, worker_id: str) -> None:
        self.removed.append(worker_id)

    def set_capacity(self, worker_id: str, cache_tokens: int) -> None:
        self.capacity[worker_id] = cache_tokens


def test_breaker_opens_after_consecutive_failures_then_half_opens_for_one_probe() -> None:
    b = Breaker(failures_to_open=3, cooldown=10.0)
    for t in (0.0, 1.0):
        b.record_failure(t)
        assert b.state(t) == "closed"
    b.record_success()  # resets the run
    for t in (2.0, 3.0, 4.0):
        b.record_failure(t)
    assert b.state(4.0) == "open" and not b.allows(13.9)
    assert b.state(14.0) == "half_open" and b.allows(14.0)
    b.on_attempt(14.0)
    assert not b.allows(14.1)  # one probe at a time
    b.record_failure(14.2)
    assert b.state(14.2) == "open" and b.state(24.2) == "half_open"
    assert b.on_attempt(24.2) and not b.on_attempt(24.2)
    b.abandon_probe()  # the probe's client left: the next request may probe
    assert b.allows(24.2) and b.on_attempt(24.2)
    b.record_success()
    assert b.state(24.3) == "closed" and b.allows(24.3)


def test_load_guard_releases_exactly_once() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    w = fleet.add_url("http://127.0.0.1:9001", "static")
    guard = LoadGuard(w)
    assert w.in_flight == 1 and w.load == 1
    guard.release()
    guard.release()
    assert w.in_flight == 0
    with pytest.raises(RuntimeError), LoadGuard(w):
        assert w.in_flight == 1
        raise RuntimeError("boom")
    assert w.in_flight == 0


def test_load_counts_no_request_twice() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry({"w1": record("w1", running=3, waiting=2)})
    w = fleet.workers["w1"]
    # The reported queue already holds this router's requests: the larger count wins.
    with LoadGuard(w):
        assert w.load == 5
    guards = [LoadGuard(w) for _ in range(7)]
    for g in guards:
        g.__enter__()
    assert w.load == 7
    assert w.load_with(remote_in_flight=2) == 9  # other replicas' in-flight (replica sync)
    for g in guards:
        g.__exit__(None, None, None)
    assert w.load == 5


def test_registry_join_leave_epoch_and_capacity() -> None:
    hooks = Hooks()
    fleet = Fleet(RouterConfig(), hooks)
    joined, left = fleet.apply_registry(
        {"w1": record("w1", cache_capacity_tokens=100), "w2": record("w2")}
    )
    assert sorted(joined) == ["w1", "w2"] and left == []
    assert hooks.capacity == {"w1": 100}
    # Same epoch: nothing dropped. New epoch: the worker restarted, its tree goes.
    assert fleet.apply_registry(
        {"w1": record("w1", cache_capacity_tokens=100), "w2": record("w2")}
    ) == ([], [])
    assert hooks.removed == []
    joined, left = fleet.apply_registry({"w1": record("w1", epoch=2.0, cache_capacity_tokens=100)})
    assert joined == ["w1"] and left == ["w2"]
    assert hooks.removed == ["w1", "w2"]
    assert set(fleet.workers) == {"w1"}


def test_missing_workers_kept_when_not_dropping_and_static_never_dropped() -> None:
    fleet = Fleet(RouterConfig(worker_urls=("http://127.0.0.1:9500",)), Hooks())
    fleet.add_url("http://127.0.0.1:9500", "static")
    fleet.apply_registry({"w1": record("w1")})
    assert fleet.apply_registry({}, drop_missing=False) == ([], [])
    assert set(fleet.workers) == {"w1", "127.0.0.1:9500"}
    assert fleet.apply_registry({}) == ([], ["w1"])
    assert set(fleet.workers) == {"127.0.0.1:9500"}


def test_routable_skips_draining_open_breaker_tried_and_other_models() -> None:
    fleet = Fleet(RouterConfig(breaker_failures=1), Hooks())
    fleet.apply_registry({f"w{i}": record(f"w{i}") for i in range(1, 5)})
    fleet.workers["w2"].draining = True
    fleet.workers["w3"].breaker.record_failure(0.0)
    fleet.workers["w4"].model = "other"
    assert [w.worker_id for w in fleet.routable(1.0)] == ["w1", "w4"]
    assert [w.worker_id for w in fleet.routable(1.0, exclude=["w1"], model="m")] == []
    assert fleet.models() == ["m", "other"]


def test_bad_worker_urls_are_refused() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    for bad in ("ftp://h:1", "http://h", "http://u:p@h:1", "http://h:1/?q=1", "h:1"):
        with pytest.raises(ValueError):
            fleet.add_url(bad, "admin")


def test_epoch_change_drops_the_real_policy_tree() -> None:
    config = RouterConfig()
    policy = build_policy(config)
    fleet = Fleet(config, policy)
    fleet.apply_registry({"w1": record("w1"), "w2": record("w2")})
    views = [WorkerView("w1", 0), WorkerView("w2", 0)]
    d = policy.select(RouteRequest("x" * 400), views, 0.0)
    assert policy.worker_stats()[d.worker_id]["tree_chars"] >= 400
    fleet.apply_registry({"w1": record("w1", epoch=5.0), "w2": record("w2", epoch=5.0)})
    assert all(s.get("tree_chars", 0) == 0 for s in policy.worker_stats().values())
