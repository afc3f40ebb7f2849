"""`radix-router up`'s restart policy and its one-line exit reports."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from pathlib import Path

from router.up.local_fleet import UpFleet, UpOptions
from router.up.restarts import Restarts, describe_exit
from router.up.watch import Watch, keeps_serving
from shared.procs import Child, last_lines, wait_until
from shared.redis_server import RedisServer


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
    said = "worker-0 exited (exit status 1); its last log line: "
    reports = [line for line in lines if line.startswith("worker-0 exited")]
    assert len(reports) == 3, lines
    assert all("No module named no_such_module_radix" in line for line in reports)
    # The only worker: nothing keeps serving, and the line says so.
    assert reports[0].startswith(said) and reports[0].endswith(
        "Restarting it in 1s (restart 1 of at most 2 within 60s); "
        "it was the only worker running: requests fail until it is back."
    )
    assert "Restarting it in 2s (restart 2 of at most 2" in reports[1]
    assert reports[2].endswith("It exited 3 times within 60s: giving up, stopping the fleet.")
    # Then its last lines, each whole, so the reason is on the screen.
    shown = lines[lines.index(reports[2]) + 1 :]
    assert shown[0] == f"Last lines of {tmp_path / 'w.log'}:"
    assert any("No module named no_such_module_radix" in line for line in shown[1:])


def test_what_keeps_serving_is_said_as_it_is() -> None:
    assert "the router is the only entry point" in keeps_serving("router", 3)
    assert keeps_serving("worker-0", 0).startswith("it was the only worker running")
    assert keeps_serving("worker-0", 1) == "the other worker keeps serving."
    assert keeps_serving("worker-0", 2) == "the other 2 workers keep serving."
    assert "re-registers with its next heartbeat" in keeps_serving("redis", 2)


def test_last_lines_start_where_lines_start(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("y" * 20000 + "\nTraceback (most recent call last):\n  boom\n\nValueError: x\n")
    assert last_lines(log, 2, window=64) == ["  boom", "ValueError: x"]
    assert last_lines(log, 10, window=64) == [
        "Traceback (most recent call last):",
        "  boom",
        "ValueError: x",
    ]  # the cut first line of the window is not shown


def test_a_killed_redis_is_reported_in_one_line_and_restarted_on_its_port(tmp_path: Path) -> None:
    """Was: the embedded Redis was left <defunct>, not counted and not restarted, and
    `up` printed nothing (issue 31)."""
    out = io.StringIO()
    redis = RedisServer(log_file=tmp_path / "redis.log").start()
    stop = threading.Event()
    watch = Watch([], redis, Restarts(), lambda s: print(s, file=out, flush=True), stop, {})
    runner = threading.Thread(target=watch.run)
    runner.start()
    try:
        pid, port = redis.pid, redis.port
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "redis is back" in out.getvalue(), 30)
        assert redis.running and redis.pid != pid and redis.port == port
        assert not Path(f"/proc/{pid}").exists()  # reaped, not <defunct>
    finally:
        stop.set()
        runner.join(10)
        redis.close()
    lines = out.getvalue().splitlines()
    report = next(line for line in lines if line.startswith("redis exited"))
    assert (
        "(killed by SIGKILL)" in report and "Restarting it in 1s (restart 1 of at most 5" in report
    )
    assert "the new Redis starts empty and each worker re-registers" in report
    assert any(line.startswith("redis is back") and "empty" in line for line in lines)
