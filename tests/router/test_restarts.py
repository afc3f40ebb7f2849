"""`radix-router up`'s restart policy and its one-line exit reports."""

from __future__ import annotations

import io
import time
from pathlib import Path

from router.up.local_fleet import UpFleet, UpOptions
from router.up.restarts import Restarts, describe_exit
from shared.procs import Child


def test_backoff_doubles_and_gives_up_past_the_limit_within_the_window() -> None:
    r = Restarts(max_restarts=3, window_s=60)
    assert [r.on_exit("w", t) for t in (0, 1, 3)] == [1, 2, 4]
    assert r.on_exit("w", 7) is None  # a 4th exit within 60 s
    assert r.on_exit("other", 7) == 1  # counted per child


def test_exits_older_than_the_window_are_forgotten() -> None:
    r = Restarts(max_restarts=2, window_s=10)
    assert r.on_exit("w", 0) == 1 and r.on_exit("w", 5) == 2
    assert r.on_exit("w", 100) == 1  # the two before are out of the window
    assert r.recent("w") == 1


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exit status 1"


def test_last_line_is_whole_and_short(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    child = Child("w", [], "", log)
    assert child.last_line() == ""
    log.write_text("x" * 20000 + "\nfirst\nTraceback: boom at the end\n\n")
    assert child.last_line() == "Traceback: boom at the end"
    log.write_text("a" * 50000)  # one line longer than the tail read: no cut line shown
    assert child.last_line() == ""
    log.write_text("start\n" + "b" * 500 + "\n")
    assert child.last_line(40) == "b" * 39 + "…"


def test_up_reports_each_exit_in_one_line_and_gives_up_on_a_child_that_keeps_exiting(
    tmp_path: Path,
) -> None:
    """`up`'s watch loop with a real child that fails at start (`python -m` of a module
    that does not exist): restarted after 1 s, then 2 s, then given up (exit 1)."""
    out = io.StringIO()
    fleet = UpFleet(UpOptions(), out=out)
    fleet.restarts = Restarts(max_restarts=2, window_s=60)
    child = Child("worker-0", ["no_such_module_radix"], "http://127.0.0.1:9", tmp_path / "w.log")
    fleet.children = [child.start()]
    fleet._launched["worker-0"] = time.monotonic()
    try:
        assert fleet._watch() == 1
    finally:
        fleet.stop()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    said = "worker-0 exited (exit status 1); its last log line: "
    assert all(line.startswith(said) and "No module named no_such_module_radix" in line
               for line in lines)  # fmt: skip
    assert lines[0].endswith("Restarting it in 1s (restart 1 of at most 2 within 60s); "
                             "the others keep serving.")  # fmt: skip
    assert "Restarting it in 2s (restart 2 of at most 2" in lines[1]
    assert lines[2].endswith("It exited 3 times within 60s: giving up, stopping the fleet.")
