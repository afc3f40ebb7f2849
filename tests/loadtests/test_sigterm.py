"""`python -m loadtests ...` stopped by SIGTERM (`timeout`, `kill`) stops the services it
started: they run in their own sessions (shared/procs.py), so nothing else would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A benchmark's shape: a service child started, torn down in `finally`.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from loadtests.__main__ import stop_on_sigterm
    from shared.procs import Child

    if sys.argv[2] == "handled":
        stop_on_sigterm()
    child = Child("sleeper", ["http.server", "--bind", "127.0.0.1", "0"], "", Path(sys.argv[1]))
    child.start()
    try:
        print(child.pid, flush=True)
        time.sleep(60)
    finally:
        child.stop(grace_s=5)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it holds no port and runs nothing.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def _run_and_terminate(tmp_path: Path, mode: str) -> int:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "child.log"), mode],
        stdout=subprocess.PIPE, text=True, env=env, cwd=root,
    )  # fmt: skip
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    parent.wait(30)
    return child_pid


@pytest.mark.parametrize("mode", ["handled", "default"])
def test_sigterm_stops_the_services_a_benchmark_started(tmp_path: Path, mode: str) -> None:
    child_pid = _run_and_terminate(tmp_path, mode)
    try:
        # The parent has exited: with the handler its `finally` already stopped the child.
        deadline = time.monotonic() + (5 if mode == "handled" else 0.5)
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Without the handler SIGTERM ends the parent before its `finally`: the child
        # is left running (the case this guards against, shown here so it can fail).
        assert _alive(child_pid) == (mode == "default")
    finally:
        if _alive(child_pid):
            os.killpg(child_pid, signal.SIGKILL)
