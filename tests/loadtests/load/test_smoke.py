"""CI smoke: headless locust against a real local sim fleet (Redis, 2 workers, router).

The same locust user runs unchanged against the router and directly against a worker.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.kit import WorkloadOptions
from loadtests.load.cluster import Cluster, ClusterSpec
from loadtests.load.records import read_records
from loadtests.load.runner import RunSpec, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKLOAD = WorkloadOptions(
    groups=4, prompts_per_group=8, system_len=200, question_len=10, output_len=8, loop=True
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    spec = ClusterSpec(
        workers=2, cache_tokens=20_000, prefill_us_per_token=20, decode_ms_per_token=2
    )
    with spec.start() as f:
        f.start_router({"log_level": "WARNING"})
        yield f


def test_ten_second_run_through_the_router(fleet: Cluster, tmp_path: Path) -> None:
    spec = RunSpec(host=fleet.router_url, out=tmp_path, users=8, run_time="10s", timeout_s=120)
    summary = run(spec, WORKLOAD, quiet=True)
    assert summary.requests > 20
    assert summary.failures == 0
    assert summary.hit_rate > 0
    # The router names the worker: both workers served and each reports cached tokens.
    assert set(summary.per_worker_requests) == {"w0", "w1"}
    assert json.loads((tmp_path / "summary.json").read_text())["failed"] == 0
    assert (tmp_path / "locust.html").stat().st_size > 0
    # Locust counts only real requests: one row per endpoint (its CSV is written a moment
    # before the last requests end, so the count is checked on its final table).
    with open(tmp_path / "locust_stats.csv") as f:
        assert {row["Name"] for row in csv.DictReader(f)} == {"/v1/chat/completions", "Aggregated"}
    check_units(summary.requests, (tmp_path / "locust.log").read_text())


# Every column of the LLM tables the locust process prints, and its unit.
WORKER_COLUMNS = {
    "worker": "id", "requests": "count", "failed": "count", "hit rate": "ratio",
    "req/s": "req/s", "goodput req/s": "req/s", "TTFT p50 ms": "ms", "TTFT p99 ms": "ms",
    "TPOT p99 ms": "ms", "E2E p99 ms": "ms",
}  # fmt: skip
RUN_ROWS = {
    "requests (failed)": "", "duration": " s", "request throughput": " req/s",
    "output token throughput": " tok/s", "total token throughput": " tok/s",
    "goodput": "no --slo given", "TTFT": " ms", "TPOT": " ms", "ITL": " ms",
    "E2E latency": " ms", "cache hit rate": "(cached / prompt tokens)",
    "prefix hits": "(cached_tokens > 0)", "max/mean requests per worker": "1.00 is even)",
}  # fmt: skip


def check_units(requests: int, log: str) -> None:
    """The locust log: the LLM tables with a unit on every figure, and locust's own tables
    with only HTTP rows (no pseudo-request under its millisecond columns)."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if "LLM serving metrics" in line)
    run_rows = {
        line[:30].strip(): line[31:] for line in lines[start + 1 : start + 2 + len(RUN_ROWS)]
    }
    assert set(run_rows) - {""} == set(RUN_ROWS), run_rows
    for row, unit in RUN_ROWS.items():
        assert run_rows[row].endswith(unit) or unit in run_rows[row], (row, run_rows[row])
    assert run_rows[""] == "mean / p50 / p90 / p99"
    head = next(line for line in lines[start:] if line.startswith("worker "))
    assert head.split() == " ".join(WORKER_COLUMNS).split()
    # Locust's request table: Type, Name, counts, then times (ms) and rates (/s).
    table = [line for line in lines if re.match(r"^\s*(POST|GET|LLM)\s|^\s*Aggregated", line)]
    assert table and all(not line.lstrip().startswith("LLM") for line in table), table
    aggregated = [line.split() for line in table if line.lstrip().startswith("Aggregated")]
    assert int(aggregated[0][1]) == requests  # the request table's # reqs


def test_one_worker_gets_everything_and_the_report_says_so(
    fleet: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every conversation starts with one system prompt, and the router's default
    # imbalance gap (64) is never reached by 4 users: all go to the prompt's holder.
    # The report lists the other worker (GET /workers) with 0 and a spread of 2.00.
    chat = WorkloadOptions(workload="multi_turn", conversations=4, turns=3, system_len=60,
                           question_len=8, output_len=8)  # fmt: skip
    spec = RunSpec(host=fleet.router_url, out=tmp_path, users=4, timeout_s=120)
    summary = run(spec, chat)
    assert summary.failures == 0
    assert sorted(summary.per_worker_requests.values()) == [0, 12]
    assert summary.load_max_over_mean == 2.0
    out = capsys.readouterr().out
    idle = next(w for w, n in summary.per_worker_requests.items() if n == 0)
    assert re.search(rf"^{idle} +0 +0 ", out, re.MULTILINE), out
    assert "max/mean requests per worker   2.00 (over 2 workers" in out
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["per_worker"][idle]["completed"] == 0 and result["load_max_over_mean"] == 2.0
    assert result["workers_from"] == "GET /workers"


def test_a_run_time_repeats_a_workload_that_runs_out_first(fleet: Cluster, tmp_path: Path) -> None:
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


def test_same_user_directly_against_a_worker(fleet: Cluster, tmp_path: Path) -> None:
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


def test_bad_requests_fail_cleanly(fleet: Cluster, tmp_path: Path) -> None:
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
