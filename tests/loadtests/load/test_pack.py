"""`python -m loadtests pack`: one command, one report, against a real local sim fleet
(Redis, sim workers and the router as processes; locust as the client). The simulator's
prediction is computed beside each live cell; sglang-router is skipped with its reason
where this Python cannot import it (the test venv has no sglang-router)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from loadtests.__main__ import main
from loadtests.load.cluster import ClusterSpec
from loadtests.load.compare import SGLANG
from loadtests.load.pack import (
    SMALL,
    TODAY_AGENTS,
    WORKLOADS,
    agrees,
    eviction_options,
    prefix_tokens,
    router_config,
    settings,
    sglang_python,
)

# vLLM's `bench serve` result fields every live cell carries (vllm/benchmarks/serve.py).
VLLM_FIELDS = (
    "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


def test_the_eviction_stress_footprint_is_two_to_three_times_the_fleet_kv() -> None:
    for size in (SMALL, SMALL.__class__("x", workers=2, cache_tokens=10_000)):
        o = eviction_options(size)
        ratio = prefix_tokens(o) / (size.workers * size.cache_tokens)
        assert 2.0 <= ratio <= 3.0, ratio


def test_hit_rates_agree_within_ten_percent_of_the_prediction() -> None:
    assert agrees(0.81, 0.9) and agrees(0.99, 0.9) and not agrees(0.80, 0.9)
    assert agrees(0.005, 0.0) and not agrees(0.05, 0.0)  # near zero: 0.01 absolute


def test_the_prediction_runs_the_live_routers_settings() -> None:
    config = router_config("cache_aware (fleet)", settings(SMALL))
    assert config.policy == "cache_aware" and config.balance_mode == "fleet"
    assert config.balance_abs_threshold == SMALL.max_running // 2
    assert 2.0 < config.tree_chars_per_token < 3.0  # what the live router learns, not 4.0
    sglang = router_config(SGLANG, settings(SMALL))  # SGLang's own defaults, not ours
    assert sglang.policy == "cache_aware" and sglang.balance_abs_threshold == 64


def test_sglang_router_runs_where_it_can_and_is_skipped_with_the_reason_elsewhere() -> None:
    assert sglang_python("/venv/bin/python") == (
        "/venv/bin/python",
        "--sglang-python /venv/bin/python",
    )
    python, why = sglang_python(None)
    if importlib.util.find_spec("sglang_router") is None:  # the test venv: not installed
        assert python is None and why.startswith("skipped: sglang_router is not importable")
    else:
        assert python == sys.executable


def test_every_workload_of_the_issue_is_a_cell() -> None:
    reasons = {e.name: e.missing() for e in WORKLOADS}
    assert set(reasons) == {"shared_prefix_zipf", "multi_turn", "rag", "mooncake",
                            "eviction_stress", "agent", "multi_tenant"}  # fmt: skip
    assert all(why is None for why in reasons.values())
    own = {e.name for e in WORKLOADS if e.cells is not None}
    assert own == {"agent", "multi_tenant"}  # their own drivers, not `compare`


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pack_agent_and_multi_tenant_cells(tmp_path: Path) -> None:
    """The two workloads with their own drivers: a cell per router, live beside the
    prediction, their own figures in the report; the agent's today side (no keys, no
    pins) beside the keyed ones."""
    out = tmp_path / "report"
    code = main([
        "pack", "--workloads", "agent,multi_tenant", "--routers", "cache_aware (fleet)",
        "--scale", "0.5", "--out", str(out), "--work", str(tmp_path / "runs"),
    ])  # fmt: skip
    assert code == 0
    report = json.loads((out / "pack.json").read_text())
    cells = {(c["workload"], c["router"]): c for c in report["cells"]}
    assert set(cells) == {("agent", "cache_aware (fleet)"), ("agent", TODAY_AGENTS),
                          ("multi_tenant", "cache_aware (fleet)")}  # fmt: skip
    for c in cells.values():
        assert c["live"]["completed"] > 0 and c["live"]["failed"] == 0
        assert 0 < c["live"]["hit_rate"] < 1
        p = c["predicted"]
        assert p["hit_rate_min"] <= p["hit_rate"] <= p["hit_rate_max"]
        assert c["agrees"] or c["gap"].startswith("live ")
    agent = cells[("agent", "cache_aware (fleet)")]
    assert agent["live"]["siblings_colocated"] >= 0.95 and "hit_after_first" in agent["predicted"]
    assert cells[("multi_tenant", "cache_aware (fleet)")]["live"]["jain"] > 0
    text = (out / "pack.md").read_text()
    for heading in ("## agent", "## multi_tenant", "hit rate after the 1st call", "Jain"):
        assert heading in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pack_end_to_end_on_a_tiny_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = main([
        "pack", "--workloads", "shared_prefix_zipf,eviction_stress",
        "--routers", "cache_aware (fleet),round_robin", "--scale", "0.34",
        "--out", str(out), "--work", str(tmp_path / "runs"),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr()
    report = json.loads((out / "pack.json").read_text())
    cells = {(c["workload"], c["router"]): c for c in report["cells"]}
    assert set(cells) == {
        (w, r) for w in ("shared_prefix_zipf", "eviction_stress")
        for r in ("cache_aware (fleet)", "round_robin")
    }  # fmt: skip
    for c in cells.values():
        assert all(c["live"][f] is not None for f in VLLM_FIELDS), c["live"]
        assert c["live"]["completed"] > 0 and c["live"]["failed"] == 0
        p = c["predicted"]
        assert p["completed"] == c["live"]["completed"]  # the same requests, predicted
        assert p["hit_rate_min"] <= p["hit_rate"] <= p["hit_rate_max"]
        assert isinstance(c["agrees"], bool) and (c["agrees"] or c["gap"].startswith("live "))
    # Routing decides the shared-prefix hit rate, live and predicted alike.
    ca, rr = cells[("shared_prefix_zipf", "cache_aware (fleet)")], cells[
        ("shared_prefix_zipf", "round_robin")]  # fmt: skip
    assert ca["live"]["hit_rate"] > rr["live"]["hit_rate"]
    assert ca["predicted"]["hit_rate"] > rr["predicted"]["hit_rate"]
    skipped = {w["name"]: w["skipped"] for w in report["workloads"]}
    assert skipped["rag"] == "not in --workloads" and skipped["eviction_stress"] is None
    evict = next(w for w in report["workloads"] if w["name"] == "eviction_stress")
    assert 2.0 <= evict["footprint_x_fleet_kv"] <= 3.0
    assert report["routers"]["sglang-router"] == "skipped: not in --routers"
    text = (out / "pack.md").read_text()
    for heading in ("## What ran", "## shared_prefix_zipf", "## eviction_stress",
                    "## Hit rate, live vs predicted", "request_throughput", "p99_ttft_ms"):  # fmt: skip
        assert heading in text
    assert (out / "pack_hit_rate.png").stat().st_size > 0
    assert (out / "pack_ttft.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pack_against_a_running_fleet_with_host(tmp_path: Path) -> None:
    """`--host`: one cell per workload, against the given router; the prediction takes
    the fleet the router lists (2 workers, their KV capacity), not the size's 4."""
    fleet = ClusterSpec(workers=2, cache_tokens=6000, prefill_us_per_token=50,
                        decode_ms_per_token=2, max_running_requests=8)  # fmt: skip
    with fleet.start() as cluster:
        cluster.start_router({"balance_abs_threshold": 4})
        cluster.flush()
        out = tmp_path / "report"
        code = main([
            "pack", "--host", cluster.router_url, "--workloads", "shared_prefix_zipf",
            "--scale", "0.34", "--out", str(out), "--work", str(tmp_path / "runs"),
        ])  # fmt: skip
    assert code == 0
    report = json.loads((out / "pack.json").read_text())
    assert report["size"]["workers"] == 2 and report["size"]["cache_tokens"] == 6000
    assert report["routers"]["run"] == [f"fleet at {cluster.router_url}"]
    (cell,) = report["cells"]
    assert cell["live"]["completed"] == cell["predicted"]["completed"] > 0
