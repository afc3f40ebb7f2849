"""`python -m loadtests compare` through real processes (Redis, sim workers, router).

The multi-turn diagnosis as a test: every conversation starts with the same system
prompt, so with the default `balance_abs_threshold` (64) a small fleet that never has
64 requests in flight routes every conversation to the worker holding that prompt;
with the threshold at the workers' scale the conversations spread. The spread counts
idle workers (a run that used one of two workers is max/mean 2.0, not 1.0).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from loadtests.kit import WorkloadOptions
from loadtests.load.cluster import ClusterSpec
from loadtests.load.compare import EVENTS, EVENTS_GPU, _setting, compare, router_settings, table
from loadtests.load.runner import RunSpec
from shared.config import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHAT = WorkloadOptions(
    workload="multi_turn", conversations=12, turns=3, system_len=60, question_len=8, output_len=8
)


def test_router_settings_reach_the_router_and_spread_conversations(tmp_path: Path) -> None:
    # Seats (8 a worker) above the 6 users: the balance rule decides, not the fleet queue.
    fleet = ClusterSpec(workers=2, cache_tokens=20_000, prefill_us_per_token=20,
                      decode_ms_per_token=4, max_running_requests=8)  # fmt: skip
    run = RunSpec(host="", out=tmp_path, users=6, timeout_s=120)
    policies = ["cache_aware (fleet)"]
    default = compare(fleet, CHAT, RunSpec(**{**run.__dict__, "out": tmp_path / "a"}), policies)
    scaled = compare(
        fleet, CHAT, RunSpec(**{**run.__dict__, "out": tmp_path / "b"}), policies,
        {"balance_abs_threshold": "1"},
    )  # fmt: skip
    d, s = default["cache_aware (fleet)"], scaled["cache_aware (fleet)"]
    assert d.requests == s.requests == 36 and d.failures == s.failures == 0
    assert set(d.per_worker_requests) == {"w0", "w1"}  # idle workers are listed too
    assert d.load_max_over_mean == 2.0  # everything on the system prompt's holder
    assert s.load_max_over_mean < 2.0 and min(s.per_worker_requests.values()) > 0
    assert "cache_aware (fleet)" in table(scaled)


def test_router_setting_parsing() -> None:
    assert _setting(" balance_abs_threshold = 8 ") == ("balance_abs_threshold", "8")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _setting("balance_abs_threshold")


def test_the_gpu_only_arm_is_the_events_arm_blind_to_host_tiers() -> None:
    events, gpu = (
        router_settings("cache_aware (fleet)" + EVENTS),
        router_settings("cache_aware (fleet)" + EVENTS_GPU),
    )
    assert gpu == {**events, "kv_events_host_weight": "0"}
    assert "kv_events_host_weight" not in events and gpu["balance_mode"] == "fleet"
    RouterConfig.model_validate({**gpu, "redis_url": "redis://127.0.0.1:1"})  # router keys


def test_events_arm_routes_on_the_workers_events() -> None:
    # The "+ events" arm's settings turn the index on over publishing sim workers: the
    # router reads each worker's stream ("ok"); the tree-alone arm's router has no feed.
    tree, events = router_settings("cost_aware"), router_settings("cost_aware" + EVENTS)
    assert "kv_events" not in tree and events["kv_events"] == "true"
    assert events["policy"] == tree["policy"] == "cost_aware"
    with ClusterSpec(workers=2, kv_events=True).start() as fleet:
        fleet.start_router(events)
        body = json.dumps({"model": "sim", "prompt": "hello there " * 20, "max_tokens": 2})
        req = urllib.request.Request(fleet.router_url + "/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200

        def statuses() -> list[object]:
            with urllib.request.urlopen(fleet.router_url + "/workers", timeout=10) as r:
                return [w["kv_events"] for w in json.load(r)["data"]]

        deadline = time.monotonic() + 20
        while statuses() != ["ok", "ok"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert statuses() == ["ok", "ok"]
        fleet.start_router(tree)
        assert statuses() == [None, None]


def test_events_arm_needs_publishing_workers(tmp_path: Path) -> None:
    # Without workers that publish, "+ events" would silently run the tree alone.
    run = RunSpec(host="", out=tmp_path)
    with pytest.raises(ValueError, match="publish"):
        compare(ClusterSpec(workers=1), CHAT, run, ["cost_aware" + EVENTS])


def test_host_tiers_get_a_fleet_each_and_the_tier_keeps_what_the_device_pool_evicts(
    tmp_path: Path,
) -> None:
    # Six conversations at once on one worker whose device pool holds about two: without
    # a tier each turn's history is evicted before its next turn; with one it is reloaded.
    fleet = ClusterSpec(workers=1, cache_tokens=1024, prefill_us_per_token=20,
                      decode_ms_per_token=2, max_running_requests=2)  # fmt: skip
    chat = WorkloadOptions(workload="multi_turn", conversations=6, turns=3, system_len=60,
                           question_len=60, output_len=8)  # fmt: skip
    run = RunSpec(host="", out=tmp_path, users=6, timeout_s=120)
    results = compare(fleet, chat, run, ["cache_aware (fleet)"], host_tiers=(0, 16_384))
    off, on = results["cache_aware (fleet), host 0"], results["cache_aware (fleet), host 16384"]
    assert off.requests == on.requests == 18 and off.failures == on.failures == 0
    assert on.hit_rate > off.hit_rate
