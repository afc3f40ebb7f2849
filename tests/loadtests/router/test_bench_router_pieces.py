"""router-pieces: each side's pieces time the real request path of a router app built by
`create_app` (the request model, a free seat in the fleet queue, the table's books), and
the table names every piece with a figure for each side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtests.router.bench_router_overhead import PIECE_NAMES


@pytest.mark.timeout(120)
def test_a_tiny_run_times_every_piece() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtests", "router-pieces", "--calls", "50", "--repeats", "1",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.stdout.splitlines()}
    for title in PIECE_NAMES.values():
        cells = rows[title].strip(" |").split(" | ")
        low, high = (float(x) for x in cells[1].split("-"))
        assert 0 < low <= high, rows[title]


@pytest.mark.timeout(120)
def test_only_times_the_pieces_named() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtests", "router-pieces", "--calls", "50", "--repeats", "1",
         "--rounds", "1", "--only", "model,serve_wrk"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows[1:]] == [
        PIECE_NAMES["model"],
        PIECE_NAMES["serve_wrk"],
    ]
