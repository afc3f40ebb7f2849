"""bench_router_tokens: every mode's router answers every request of the conversations,
and the summary says 'NO' when any one round is over the target (a range, not a best)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from loadtests.router.bench_router_tokens import summary


def test_one_round_over_the_target_is_a_no() -> None:
    args = argparse.Namespace(rounds=3, requests=10, tokenizer="sim", target=1.5)
    cpu = {"off": [1.0, 1.0, 2.0], "tok": [1.2, 1.4, 2.2], "on": [1.4, 1.6, 2.4]}
    lines = {line.split()[0]: line for line in summary(cpu, args).splitlines()[2:]}
    assert "1.200-2.200 ms  ratio 1.10-1.40x" in lines["tok"]
    assert "every round: yes); beyond off 200-400 us" in lines["tok"]
    assert (
        "ratio 1.20-1.60x" in lines["on"] and "every round: NO); beyond off 400-600" in lines["on"]
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_run_measures_every_mode() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtests", "router-tokens", "--requests", "8",
         "--sessions", "4", "--words", "30", "--rounds", "1", "--aa", "--idle", "1"],
        capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "round 0 (8 requests each" in out.stdout
    for mode in ("tok", "on", "off2"):
        assert any(line.strip().startswith(mode) and "ratio" in line
                   for line in out.stdout.splitlines()), out.stdout  # fmt: skip
    # `--idle`: the idle rates, then every mode's ratio again without them
    _, idle = out.stdout.split("\nidle CPU over 1 s, ms a second: ")
    assert all(f"{mode} " in idle.splitlines()[0] for mode in ("off", "tok", "on", "off2"))
    assert sum("ratio" in line for line in idle.splitlines()) == 3, idle
