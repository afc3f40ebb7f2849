"""`python -m loadtests worker-http`: real worker subprocesses (this tree and a git ref),
every token counted, the worker's own CPU per token reported."""

from __future__ import annotations

import asyncio

import pytest

from loadtests.__main__ import main
from loadtests.engine import bench_worker_http as bench

pytestmark = pytest.mark.timeout(180)


def test_drive_counts_the_tokens_of_overlapping_jobs() -> None:
    async def one(i: int, prompt: str) -> int:
        await asyncio.sleep(0.01 * (i % 3))  # jobs finish out of order, overlapping
        return i + 1

    phase = asyncio.run(bench.drive([f"p{i}" for i in range(12)], 4, one))
    assert phase.requests == 12 and phase.tokens == sum(range(1, 13))
    assert len(phase.latencies) == 12


def test_a_small_run_against_this_tree_and_head(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "worker-http",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--max-tokens",
            "5",
            "--before-ref",
            "HEAD",
        ]
    )
    rows = {
        cells[0]: cells[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| path")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {
        "in-process engine", "JSON, before (HEAD)", "JSON, this tree",
        "SSE, before (HEAD)", "SSE, this tree",
    }  # fmt: skip
    for name, (reqs, _rps, _p50, _p99, tokens_s, cpu, events) in rows.items():
        assert int(reqs) == 6 and float(tokens_s) > 0 and float(cpu) >= 0, name
        if name.startswith("SSE"):
            assert 0 < float(events) <= 1, name  # at most one delta event per token
