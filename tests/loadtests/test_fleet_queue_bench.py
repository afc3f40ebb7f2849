"""The fleet-queue benchmark's arithmetic (loadtests/fleet_queue.py): fair shares,
Jain's index, and a schedule that is the same for both routers."""

from __future__ import annotations

import argparse

import pytest

from loadtests.load.fleet_queue import (
    add_arguments,
    defaults,
    fair_shares,
    jain,
    router_config,
    schedule,
    this_tree_sides,
)


def test_fair_shares_cap_each_tenant_at_what_it_sent() -> None:
    # 3 tenants share 9: the small one gets all it sent, the rest split what is left.
    assert fair_shares({"a": 2, "b": 10, "c": 10}, 9) == {"a": 2, "b": 3.5, "c": 3.5}
    assert fair_shares({"a": 5, "b": 5}, 20) == {"a": 5, "b": 5}


def test_jain() -> None:
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)


def test_the_flooder_sends_its_multiple_and_the_schedule_is_seeded() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--seconds", "200", "--tenants", "4", "--flood", "10"])
    plan = schedule(args, rate=13.0)  # a share of 1 req/s: t0 at 10, the others at 1
    counts = {t: sum(s.tenant == t for s in plan) for t in ("t0", "t1", "t2", "t3")}
    assert 1700 < counts["t0"] < 2300 and all(150 < counts[t] < 250 for t in ("t1", "t2", "t3"))
    assert [(s.at, s.prompt) for s in schedule(args, 13.0)] == [(s.at, s.prompt) for s in plan]
    assert {s.klass for s in plan} == {"interactive", "standard", "batch"}


def test_seat_factors_run_this_tree_once_per_factor_in_order() -> None:
    args = defaults()
    assert [(n, a.seat_factor) for n, a in this_tree_sides(args)] == [("this tree", 1.0)]
    args.seat_factors = "1.25,1"
    sides = this_tree_sides(args)
    assert [n for n, _ in sides] == ["seats x1.25", "seats x1"]
    # Each side's router gets its own factor; the namespace it came from is not changed.
    configs = [router_config(a, new=True, sync=False) for _, a in sides]
    assert [c["queue_seat_factor"] for c in configs] == [1.25, 1.0]
    assert args.seat_factor == 1.0
