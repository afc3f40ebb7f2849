"""`python -m loadtests NAME`: one way to start every benchmark, with useful --help,
progress lines and verdicts."""

from __future__ import annotations

import argparse
import io
import re

import pytest

from loadtests.__main__ import COMMANDS, SECTIONS, main
from loadtests.kit import HelpFormatter, Progress
from loadtests.load.records import RequestRecord
from loadtests.load.runner import seconds_of, summarize, verdict


def test_the_list_names_every_command_under_its_section(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    heads = [line.split(":")[0] for line in out.splitlines() if line and not line[0].isspace()]
    assert [h for h in heads if h in SECTIONS] == list(SECTIONS)  # each once, in order
    section = None
    for line in out.splitlines():
        if line.split(":")[0] in SECTIONS:
            section = line.split(":")[0]
        elif line.startswith("  "):
            name = line.split()[0]
            # the section is the folder of the command's module: loadtests.SECTION.module
            assert COMMANDS[name][0].split(".")[1] == section, (name, section)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help_with_defaults(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m loadtests {name}")
    assert "(default: " in out


def test_unknown_command_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no command 'nope'")


def test_help_formatter_shows_defaults_once() -> None:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--users", type=int, default=16, help="users (default: %(default)s)")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = p.format_help()
    assert re.search(r"--seed SEED +\(default: 0\)", text)
    assert text.count("(default: 16)") == 1 and "(default: False)" not in text


def test_progress_estimates_what_is_left_from_the_pace() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress("compare", 4, out=out, clock=lambda: now[0])
    progress.say("starting")
    now[0] = 10.0
    progress.finished("fleet up")
    now[0] = 12.0
    progress.say("round_robin: running")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[compare 1/4  0:00 elapsed] starting"
    assert lines[1] == "[compare 1/4  0:10 elapsed, ~0:30 left] fleet up"
    assert lines[2] == "[compare 2/4  0:12 elapsed, ~0:36 left] round_robin: running"


def test_run_time_and_the_verdict() -> None:
    assert [seconds_of(t) for t in ("90", "20s", "1m30s", "1h")] == [90, 20, 90, 3600]
    with pytest.raises(ValueError, match="run-time"):
        seconds_of("soon")
    ok = RequestRecord(start=0.0, ok=True, e2e_s=0.1, ttft_s=0.05, prompt_tokens=10)
    bad = RequestRecord(start=0.1, ok=False, e2e_s=0.1, error="HTTP 400: prompt too long")
    records = [ok, bad, bad]
    line = verdict(summarize(records), records)
    assert line.startswith("verdict: FAILED, 2 of 3 requests failed")
    assert "(2x): HTTP 400: prompt too long" in line
    assert verdict(summarize([ok]), [ok]).startswith("verdict: OK, 1 requests")
    table = summarize([bad, bad]).table()
    assert "prefix hits" in table
    assert (
        "nan" not in table and "TTFT                           n/a (no request succeeded)" in table
    )


def _on(worker: str, cached: int, i: int) -> RequestRecord:
    return RequestRecord(start=i * 0.1, ok=True, e2e_s=0.1, ttft_s=0.05, prompt_tokens=100,
                         cached_tokens=cached, worker=worker)  # fmt: skip


def test_an_uneven_spread_is_explained_by_affinity_or_not() -> None:
    """Was: the README's first run sent every request to one of two workers and said
    "OK" at max/mean 2.00 with no word why (issue 31)."""
    records = [_on("worker-0", 0 if i == 0 else 80, i) for i in range(20)]
    summary = summarize(records, workers=["worker-0", "worker-1"])
    line = verdict(summary, records)
    assert line.startswith("verdict: OK, 20 requests")
    assert "uneven load, max/mean 2.00 (worker-0 answered 100%): cache affinity, 95% of " \
        "requests hit a cached prefix" in line  # fmt: skip
    assert summary.to_dict()["prefix_hit_share"] == 0.95
    cold = [_on("worker-0", 0, i) for i in range(20)]
    line = verdict(summarize(cold, workers=["worker-0", "worker-1"]), cold)
    assert "not cache affinity (only 0% of requests hit a cached prefix)" in line
    even = [_on(f"worker-{i % 2}", 80, i) for i in range(20)]
    assert "uneven" not in verdict(summarize(even, workers=["worker-0", "worker-1"]), even)
