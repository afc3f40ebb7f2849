"""Fleet table units: breaker states, the load guard, registry sync, routable filtering,
the books the table keeps, and the routable view kept current between requests."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.fleet.table import Attempt, Fleet
from router.fleet.workers import Breaker, FailureKind, Worker
from router.policy import build_routing
from router.policy.base import RouteRequest, WorkerView
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord


def record(wid: str, epoch: float = 1.0, **kw: object) -> WorkerRecord:
    return WorkerRecord(wid, f"http://127.0.0.1:{9000 + int(wid[1:])}", "m", "sim", epoch, **kw)  # type: ignore[arg-type]


class Hooks:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def forget(self, worker_id: str) -> None:
        self.removed.append(worker_id)

    def answered(self, *_: object) -> None:
        return


def fail(fleet: Fleet, worker: Worker, now: float) -> None:
    """One failed try, as the proxy reports it."""
    with fleet.attempt(worker, now) as attempt:
        fleet.failed(attempt, FailureKind.CONNECT, now)


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


def test_an_attempt_releases_its_load_exactly_once() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    w = fleet.add_url("http://127.0.0.1:9001", "static")
    attempt = fleet.attempt(w, 0.0)
    assert w.in_flight == 1 and w.load == 1
    attempt.release()
    attempt.release()
    assert w.in_flight == 0
    with pytest.raises(RuntimeError), fleet.attempt(w, 0.0):
        assert w.in_flight == 1
        raise RuntimeError("boom")
    assert w.in_flight == 0


def test_load_counts_no_request_twice() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry({"w1": record("w1", running=3, waiting=2)})
    w = fleet.workers["w1"]
    # The reported queue already holds this router's requests: the larger count wins.
    with fleet.attempt(w, 0.0):
        assert w.load == 5
    attempts = [fleet.attempt(w, 0.0) for _ in range(7)]
    assert w.load == 7
    assert w.load_with(remote_in_flight=2) == 9  # other replicas' in-flight (replica sync)
    for a in attempts:
        a.__exit__(None, None, None)
    assert w.load == 5


def routable(
    fleet: Fleet, now: float, exclude: Iterable[str] = (), model: str | None = None
) -> list[Worker]:
    """The plain definition of who may take a request: what `Fleet.view` maintains."""
    skip = set(exclude)
    return [
        w
        for w in fleet.workers.values()
        if w.worker_id not in skip
        and not w.report.draining
        and w.breaker.allows(now)
        and (model is None or not w.report.model or w.report.model == model)
    ]


def test_registry_join_leave_epoch_and_capacity() -> None:
    hooks = Hooks()
    fleet = Fleet(RouterConfig(), hooks)
    joined, left = fleet.apply_registry(
        {"w1": record("w1", kv_capacity_tokens=100), "w2": record("w2")}
    )
    assert sorted(joined) == ["w1", "w2"] and left == []
    view = fleet.view(0.0)
    assert view.capacities == (100, 0)  # every reported figure reaches the policy here only
    # Every read writes each heartbeat, as read and when, into the kept view in place.
    beat = record("w2", queued_prefill_tokens=7, prefill_us_per_token=20.0)
    fleet.apply_registry({"w1": record("w1", kv_capacity_tokens=100), "w2": beat}, now=3.0)
    written = view.reported
    assert fleet.view(3.0) is view and view.reports[1] is beat and view.reported_at[1] == 3.0
    assert written >= 2 and fleet.workers["w2"].report is beat
    fleet.apply_registry({"w1": record("w1", kv_capacity_tokens=100), "w2": beat}, now=4.0)
    assert view.reported_at[1] == 4.0 and view.reported == written + 2  # the same figures again
    # Same epoch: nothing dropped. New epoch: the worker restarted, its tree goes.
    assert fleet.apply_registry(
        {"w1": record("w1", kv_capacity_tokens=100), "w2": record("w2")}
    ) == ([], [])
    assert hooks.removed == []
    joined, left = fleet.apply_registry({"w1": record("w1", epoch=2.0, kv_capacity_tokens=100)})
    assert joined == ["w1"] and left == ["w2"]
    assert hooks.removed == ["w1", "w2"]
    assert set(fleet.workers) == {"w1"}


def test_a_workers_tree_cap_follows_its_device_and_host_capacity() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry({"w1": record("w1", kv_capacity_tokens=100), "w2": record("w2")})
    assert fleet.view(0.0).capacities == (100, 0)
    fleet.apply_registry(
        {"w1": record("w1", kv_capacity_tokens=100, host_kv_capacity_tokens=800),
         "w2": record("w2")}
    )  # fmt: skip
    assert fleet.view(0.0).capacities == (900, 0)  # a new host tier: the column is replaced


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
    fleet.apply_registry({f"w{i}": record(f"w{i}", draining=i == 2) for i in range(1, 5)})
    fail(fleet, fleet.workers["w3"], 0.0)
    fleet.set_model(fleet.workers["w4"], "other")
    assert [w.worker_id for w in routable(fleet, 1.0)] == ["w1", "w4"]
    assert [w.worker_id for w in routable(fleet, 1.0, exclude=["w1"], model="m")] == []
    assert fleet.view(1.0).ids == ("w1", "w4")
    assert fleet.view(1.0, "m", exclude=["w1"]).ids == ()
    assert fleet.models() == {"m": None, "other": None}


def test_bad_worker_urls_are_refused() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    for bad in ("ftp://h:1", "http://h", "http://u:p@h:1", "http://h:1/?q=1", "h:1"):
        with pytest.raises(ValueError):
            fleet.add_url(bad, "admin")


def test_epoch_change_drops_the_real_policy_tree() -> None:
    config = RouterConfig()
    policy = build_routing(config)
    fleet = Fleet(config, policy.holdings)
    fleet.apply_registry({"w1": record("w1"), "w2": record("w2")})
    views = [WorkerView("w1", 0), WorkerView("w2", 0)]
    d = policy.select(RouteRequest("x" * 400), views, 0.0)
    assert policy.holdings.worker_stats()[d.worker_id]["tree_chars"] >= 400
    fleet.apply_registry({"w1": record("w1", epoch=5.0), "w2": record("w2", epoch=5.0)})
    assert all(s.get("tree_chars", 0) == 0 for s in policy.holdings.worker_stats().values())


# -- the maintained view equals the plain definition after every kind of event ---------

MODELS = ("m", "other", "")
COOLDOWN = 5.0  # time steps below are multiples of 0.5: they land exactly on cooldown ends


def expected(
    fleet: Fleet, now: float, model: str | None, exclude: list[str], remote: dict[str, int]
) -> tuple[object, ...]:
    ws = routable(fleet, now, exclude=exclude, model=model)
    return (
        tuple(w.worker_id for w in ws),
        [w.load_with(remote.get(w.worker_id, 0)) for w in ws],
        tuple(w.report.kv_capacity_tokens for w in ws),
        [w.report for w in ws],
        [w.reported_at for w in ws],
    )


def assert_views_match(fleet: Fleet, now: float, remote: dict[str, int]) -> None:
    for model in (None, "m", "other", "", "unknown"):
        for exclude in ([], sorted(fleet.workers)[:1]):
            view = fleet.view(now, model, exclude=exclude)
            got = (
                view.ids,
                list(view.loads),
                view.capacities,
                list(view.reports),
                list(view.reported_at),
            )
            assert got == expected(fleet, now, model, exclude, remote), (model, exclude)
    for model in ("m", "other", "unknown"):
        assert fleet.knows_model(model) == (
            any(w.report.model == model for w in fleet.workers.values())
            or not any(w.report.model for w in fleet.workers.values())
        )


EVENT_KINDS = (
    "heartbeat", "leave", "static", "admin_remove", "fail", "succeed", "attempt",
    "abandon", "tick", "guard", "release", "remote", "drain", "probe_model", "restart",
)  # fmt: skip


class Driver:
    """Applies events the way the router's components do, to one fleet."""

    def __init__(self) -> None:
        self.remote: dict[str, int] = {}
        config = RouterConfig(breaker_failures=2, breaker_cooldown=COOLDOWN)
        self.fleet = Fleet(config, Hooks(), lambda: self.remote)
        self.now = 0.0
        self.registry: dict[str, WorkerRecord] = {}
        self.attempts: list[Attempt] = []

    def apply(self, kind: str, n: int, value: int) -> None:
        fleet, wid = self.fleet, f"w{n}"
        ids = sorted(fleet.workers)
        worker = fleet.workers[ids[n % len(ids)]] if ids else None  # registry or static
        if kind == "heartbeat":  # join, or a new queue / capacity / draining / model
            self.registry[wid] = WorkerRecord(
                wid, f"http://127.0.0.1:{9000 + n}", MODELS[value % 3], "sim", 1.0,
                running=value % 5, waiting=value // 5, kv_capacity_tokens=100 * (value % 3),
                draining=value == 7,
            )  # fmt: skip
            fleet.apply_registry(self.registry, now=self.now)
        elif kind == "leave":
            self.registry.pop(wid, None)
            fleet.apply_registry(self.registry, drop_missing=value % 2 == 0, now=self.now)
        elif kind == "restart" and wid in self.registry:
            self.registry[wid] = WorkerRecord(
                **{**self.registry[wid].__dict__, "epoch": 2.0 + value}
            )
            fleet.apply_registry(self.registry, now=self.now)
        elif kind == "static":
            fleet.add_url(f"http://127.0.0.{n + 2}:8000", "static" if value % 2 else "admin")
        elif kind == "tick":
            self.now += 0.5 * value
        elif kind == "release" and self.attempts:
            self.attempts.pop(value % len(self.attempts)).release()
        elif kind == "abandon" and self.attempts:  # a probe's client left: no verdict
            self.attempts.pop().release()
        elif kind == "remote":  # replica sync replaces the mapping
            self.remote = {
                **self.remote,
                wid if value % 2 else ids[n % len(ids)] if ids else wid: value % 4,
            }
        elif worker is None:
            return
        elif kind == "admin_remove":
            fleet.remove(worker.worker_id)
        elif kind in ("guard", "attempt"):  # a try held open (the probe, when half-open)
            self.attempts.append(fleet.attempt(worker, self.now))
        elif kind in ("fail", "succeed"):  # the verdict of a held try, or of a fresh one
            held = [a for a in self.attempts if a.worker is worker]
            attempt = held[-1] if held else fleet.attempt(worker, self.now)
            if kind == "fail":
                fleet.failed(attempt, FailureKind.CONNECT, self.now)
            else:
                fleet.succeeded(attempt)
            if not held:
                attempt.release()
        elif kind == "drain" and worker.worker_id in self.registry:  # a heartbeat says so
            old = self.registry[worker.worker_id]
            self.registry[worker.worker_id] = WorkerRecord(
                **{**old.__dict__, "draining": not old.draining}
            )
            fleet.apply_registry(self.registry, now=self.now)
        elif kind == "probe_model":
            fleet.set_model(worker, MODELS[value % 3])  # what GET /v1/models does

    def check(self) -> None:
        assert_views_match(self.fleet, self.now, self.remote)

    def finish(self) -> None:
        self.check()
        for attempt in self.attempts:
            attempt.release()
        self.check()
        assert all(w.in_flight == 0 for w in self.fleet.workers.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(EVENT_KINDS), st.integers(0, 2), st.integers(0, 12), st.booleans()
        ),
        max_size=60,
    )
)
def test_view_equals_a_from_scratch_filter_after_any_events(
    events: list[tuple[str, int, int, bool]],
) -> None:
    driver = Driver()
    for kind, n, value, check in events:
        driver.apply(kind, n, value)
        if check:  # sometimes several events pass between two requests
            driver.check()
    driver.finish()


@pytest.mark.parametrize("seed", range(6))
def test_view_equals_a_from_scratch_filter_on_long_random_walks(seed: int) -> None:
    # Long walks reach what short examples rarely do: a breaker opening, cooling down,
    # probing and closing while loads move. Biased toward the frequent events.
    rng = random.Random(seed)
    weights = {k: 1 for k in EVENT_KINDS} | {"guard": 4, "release": 3, "fail": 3, "tick": 3}
    kinds, w = list(weights), list(weights.values())
    driver = Driver()
    for _ in range(600):
        driver.apply(rng.choices(kinds, w)[0], rng.randrange(4), rng.randrange(13))
        if rng.random() < 0.7:
            driver.check()
    driver.finish()


def test_open_breaker_rejoins_the_view_exactly_when_its_cooldown_ends() -> None:
    fleet = Fleet(RouterConfig(breaker_failures=1, breaker_cooldown=0.1), Hooks())
    fleet.apply_registry({"w1": record("w1"), "w2": record("w2")})
    t0 = 1000.3  # opened_at + cooldown is not exact in binary floating point
    w1 = fleet.workers["w1"]
    fail(fleet, w1, t0)
    assert fleet.view(t0).ids == ("w2",)
    end = w1.breaker.half_open_at()
    assert fleet.view(math.nextafter(end, 0)).ids == ("w2",)
    assert fleet.view(end).ids == ("w1", "w2")  # no event: time alone half-opens it
    # The probe takes it out again until its verdict; a failed probe re-opens it.
    probe = fleet.attempt(w1, end)
    assert probe.probe
    assert fleet.view(end).ids == ("w2",)
    fleet.failed(probe, FailureKind.TIMEOUT, end + 0.01)
    probe.release()
    assert fleet.view(end + 0.01).ids == ("w2",)
    with fleet.attempt(w1, end + 0.01) as attempt:
        fleet.succeeded(attempt)
    assert fleet.view(end + 0.01).ids == ("w1", "w2")


def test_loads_are_written_in_place_and_membership_changes_replace_the_columns() -> None:
    remote: dict[str, int] = {}  # other replicas' in-flight, as replica sync provides it
    fleet = Fleet(RouterConfig(), Hooks(), lambda: remote)
    fleet.apply_registry({"w1": record("w1", running=1), "w2": record("w2")})
    view = fleet.view(0.0)
    loads, ids = view.loads, view.ids
    attempt = fleet.attempt(fleet.workers["w2"], 0.0)
    attempt.__enter__()
    attempt.__enter__()  # entering twice is one request, as before
    assert fleet.view(0.0) is view and loads == [1, 1]
    fleet.apply_registry({"w1": record("w1", running=4, waiting=2), "w2": record("w2")})
    remote = {"w2": 3}  # the provider replaces its mapping when a count moves
    assert fleet.view(0.0).loads is loads and loads == [6, 4]
    attempt.release()
    assert loads == [6, 3]
    remote = {}
    assert fleet.view(0.0).loads is loads and loads == [6, 0]
    # The policy notices fleet changes by the identity of `ids`: a change gives new tuples.
    fleet.apply_registry(
        {"w1": record("w1", running=4, waiting=2, draining=True), "w2": record("w2")}
    )
    assert fleet.view(0.0).ids == ("w2",) and ids == ("w1", "w2")


def test_an_attempt_on_a_removed_worker_leaves_its_successor_alone() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    old = fleet.add_url("http://127.0.0.1:9001", "admin")
    attempt = fleet.attempt(old, 0.0)
    fleet.remove(old.worker_id)
    new = fleet.add_url("http://127.0.0.1:9001", "admin")
    assert fleet.view(0.0).loads == [0]
    attempt.release()  # the old request ends after the worker was replaced
    assert old.in_flight == 0 and new.in_flight == 0 and fleet.view(0.0).loads == [0]


def test_one_view_per_served_model_and_the_fleet_view_when_one_model() -> None:
    fleet = Fleet(RouterConfig(), Hooks())
    fleet.apply_registry({"w1": record("w1"), "w2": record("w2")})
    static = fleet.add_url("http://127.0.0.1:9500", "static")  # reports no model: serves any
    assert fleet.view(0.0, "m") is fleet.view(0.0)  # one model served: one view
    fleet.apply_registry(
        {"w1": record("w1"), "w2": WorkerRecord(**{**record("w2").__dict__, "model": "x"})}
    )
    assert fleet.view(0.0, "m").ids == ("w1", static.worker_id)
    assert fleet.view(0.0, "x").ids == ("w2", static.worker_id)
    assert fleet.view(0.0, "m") is fleet.view(0.0, "m")
    assert fleet.view(0.0, "nobody").ids == (static.worker_id,)  # not kept: a fresh one-off
    assert fleet.view(0.0, "nobody") is not fleet.view(0.0, "nobody")
    assert not fleet.knows_model("nobody") and fleet.knows_model("x")


def test_the_table_keeps_the_books_of_every_attempt() -> None:
    from router.metrics import Metrics

    fleet = Fleet(RouterConfig(breaker_failures=2, breaker_cooldown=5.0), Hooks())
    fleet.apply_registry({"w1": record("w1")})
    w1 = fleet.workers["w1"]
    with fleet.attempt(w1, 0.0) as attempt:
        assert (w1.in_flight, w1.requests_total, fleet.view(0.0).loads) == (1, 1, [1])
        fleet.succeeded(attempt, predicted_tokens=4.0, cached_tokens=3)
    assert (w1.in_flight, w1.predicted_tokens_total, w1.actual_cached_tokens_total) == (0, 4, 3)
    # A busy worker is alive: BUSY counts toward no breaker; the other kinds do.
    for kind in (FailureKind.BUSY, FailureKind.CONNECT, FailureKind.BUSY):
        with fleet.attempt(w1, 1.0) as attempt:
            fleet.failed(attempt, kind, 1.0)
    assert w1.failures_total == 1 and w1.breaker.state(1.0) == "closed"
    with fleet.attempt(w1, 1.0) as attempt:
        fleet.failed(attempt, FailureKind.UPSTREAM_5XX, 1.0)
    assert w1.failures_total == 2 and w1.breaker.state(1.0) == "open"
    assert fleet.view(1.0).ids == ()
    # Metrics only read the table: one count per failure, not a second one of their own.
    text = Metrics(fleet, lambda: 1.0).render().decode()
    assert 'radix_router_upstream_failures_total{worker="w1"} 2.0' in text
    assert 'radix_router_actual_cached_tokens_total{worker="w1"} 3.0' in text
