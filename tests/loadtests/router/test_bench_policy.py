"""`python -m loadtests policy-cost` runs cost_aware with heartbeats next to its frozen
reference (tests/router/cost_aware_reference.py) and says whether every decision agreed."""

from __future__ import annotations

import pytest

from loadtests.__main__ import main

SMALL = ["--requests", "40", "--warmup", "40", "--groups", "6", "--system-chars", "300",
         "--tail-chars", "30", "--reports", "2"]  # fmt: skip


def test_cost_aware_and_its_reference_agree_on_every_decision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(
        [
            "policy-cost",
            "--workers",
            "4,20",
            "--policies",
            "cost_aware,cost_aware_reference",
            *SMALL,
        ]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if "| cost_aware (" in line]
    assert len(rows) == 4  # two sizes, list and FleetView
    assert all(row.rstrip().endswith("| yes |") for row in rows), rows
