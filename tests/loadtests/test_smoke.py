"""CI smoke: headless locust against a real local sim fleet (Redis, 2 workers, router).

The same locust user runs unchanged against the router and directly against a worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.fleet import BenchFleet, FleetSpec
from loadtests.metrics import read_records
from loadtests.options import WorkloadOptions
from loadtests.runner import RunSpec, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKLOAD = WorkloadOptions(
    groups=4, prompts_per_group=8, system_len=200, question_len=10, output_len=8, loop=True
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[BenchFleet]:
    spec = FleetSpec(workers=2, cache_tokens=20_000, prefill_us_per_token=20, decode_ms_per_token=2)
    with spec.start() as f:
        f.start_router({"log_level": "WARNING"})
        yield f


def test_ten_second_run_through_the_router(fleet: BenchFleet, tmp_path: Path) -> None:
    spec = RunSpec(host=fleet.router_url, out=tmp_path, users=8, run_time="10s", timeout_s=120)
    summary = run(spec, WORKLOAD, quiet=True)
    assert summary.requests > 20
    assert summary.failures == 0
    assert summary.hit_rate > 0
    # The router names the worker: both workers served and each reports cached tokens.
    assert set(summary.per_worker_requests) == {"w0", "w1"}
    assert json.loads((tmp_path / "summary.json").read_text())["failures"] == 0
    stats = (tmp_path / "locust_stats.csv").read_text()
    assert "ttft" in stats and "tokens/s" in stats and "/v1/chat/completions" in stats
    assert (tmp_path / "locust.html").stat().st_size > 0


def test_a_run_time_repeats_a_workload_that_runs_out_first(
    fleet: BenchFleet, tmp_path: Path
) -> None:
    # Two requests, no --loop: without a run time the run ends after them; with one the
    # workload starts over until the time is up (the README's `-t` runs rely on it).
    tiny = WorkloadOptions(
        groups=1, prompts_per_group=2, system_len=20, question_len=4, output_len=2
    )
    assert not tiny.loop
    once = run(RunSpec(host=fleet.router_url, out=tmp_path / "once", users=1), tiny, quiet=True)
    assert once.requests == 2
    timed = RunSpec(host=fleet.router_url, out=tmp_path / "timed", users=1, run_time="3s")
    assert run(timed, tiny, quiet=True).requests > 2


def test_same_user_directly_against_a_worker(fleet: BenchFleet, tmp_path: Path) -> None:
    workload = WorkloadOptions(
        workload="multi_turn", conversations=4, turns=3, system_len=50, question_len=8, output_len=8
    )
    spec = RunSpec(host=fleet.worker_urls[0], out=tmp_path, users=4, timeout_s=120)
    summary = run(spec, workload, quiet=True)
    assert (summary.requests, summary.failures) == (12, 0)  # ends by itself with the workload
    assert summary.hit_rate > 0  # later turns reuse earlier ones
    records = read_records(tmp_path / "records.jsonl")
    assert {r.worker for r in records} == {"direct"}
    assert all(r.ttft_s is not None and r.output_tokens == 8 for r in records)


def test_bad_requests_fail_cleanly(fleet: BenchFleet, tmp_path: Path) -> None:
    # A prompt larger than the worker's KV cache is rejected with a 4xx in the OpenAI
    # error shape: the user records a failure and the run carries on.
    workload = WorkloadOptions(
        groups=1, prompts_per_group=2, system_len=15_000, question_len=5, output_len=8
    )
    spec = RunSpec(host=fleet.router_url, out=tmp_path, users=2, timeout_s=120)
    summary = run(spec, workload, quiet=True)
    assert (summary.requests, summary.failures) == (2, 2)
    errors = [r.error for r in read_records(tmp_path / "records.jsonl")]
    # The engine caps a prompt at min(model context, KV pool): either limit names itself.
    assert all(
        e.startswith("HTTP 400") and ("KV cache" in e or "context length" in e) for e in errors
    ), errors
