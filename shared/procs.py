"""Service child processes: start one, wait until it answers, stop it and all it spawned.

Used by `radix-router up` (router/up/local_fleet.py), the benchmarks' local clusters
(`loadtests/load/cluster.py`) and the end-to-end tests, so the mechanics live once:

- each child runs `python -m <module> ...` in its own session (process group), so a
  signal sent to the group reaches exactly it and whatever it spawned, and a terminal
  Ctrl-C reaches only the parent, which then stops children in order;
- output goes to one log file per child (read back for error messages and by tests);
- `stop` is SIGTERM to the group, a grace period, then SIGKILL to whatever is left;
- every wait is bounded and fails with the child's log tail when it dies or times out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from shared.redis_server import free_port

__all__ = ["Child", "free_port", "http_json", "last_lines", "wait_health", "wait_until"]


@dataclass
class Child:
    """One service process: `python -m <args...>`, its base URL and its log file."""

    name: str
    args: list[str]  # after `python -m`, e.g. ["worker", "serve", "--port", "8001"]
    url: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    python: str = sys.executable  # another venv's Python runs a peer (e.g. sglang-router)

    def start(self) -> Self:
        # Append: a restarted child (same name) keeps the earlier run's output readable.
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", *self.args], cwd=self.cwd, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True,
            )  # fmt: skip
        return self

    def fresh(self) -> Self:
        """A not-yet-started copy (same command line, URL and log) for a restart."""
        return type(self)(
            self.name, self.args, self.url, self.log, self.env, self.cwd, python=self.python
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def last_line(self, max_chars: int = 240) -> str:
        """The last non-empty line of the log, whole (a tail cut at a byte offset starts
        mid-line), shortened to `max_chars` with an ellipsis: for one-line reports."""
        lines = last_lines(self.log, 1)
        last = lines[0].strip() if lines else ""
        return last if len(last) <= max_chars else last[: max_chars - 1] + "…"

    def signal(self, sig: int) -> None:
        """Signal the child's whole process group (pgid == pid: its own session)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the group, up to `grace_s` to exit, then SIGKILL to what is left."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(max(0.1, grace_s))
        self.signal(signal.SIGKILL)  # anything left in the group, the child included
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def last_lines(path: Path, count: int, window: int = 16384) -> list[str]:
    """The last `count` non-empty lines of a file, each whole: read from `window` bytes
    before the end, and a line the window cut is dropped, so the first one shown starts
    where a line starts (a reader of a failure sees no half a traceback line)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - window))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    if size > window and lines:
        lines = lines[1:]  # the first one is cut
    kept = [ln.rstrip() for ln in lines if ln.strip()]
    return kept[-count:] if count > 0 else []


def http_json(
    url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> tuple[int, Any]:  # fmt: skip
    """(status, parsed JSON or None); errors with a body are answers, not exceptions.
    Connection failures raise OSError (URLError is one)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def wait_until(
    check: Callable[[], bool], timeout: float, child: Child | None = None, poll_s: float = 0.05,
    stop: threading.Event | None = None,
) -> float:  # fmt: skip
    """Poll `check()` until true and return the seconds it took. Raises RuntimeError if
    `child` exits first, TimeoutError (with its log tail) when time runs out, and
    InterruptedError as soon as `stop` is set (a Ctrl-C during `radix-router up`)."""
    start = time.monotonic()
    while not check():
        if child is not None and child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited {child.proc.returncode}: {child.tail()}")
        if time.monotonic() - start > timeout:
            tail = child.tail() if child else ""
            raise TimeoutError(f"condition not met within {timeout}s {tail}")
        if stop is not None:
            if stop.wait(poll_s):
                raise InterruptedError("interrupted")
        else:
            time.sleep(poll_s)
    return time.monotonic() - start


def answers_health(url: str, headers: dict[str, str] | None = None) -> bool:
    """True once GET {url}/health answers 200."""
    try:
        return http_json(url + "/health", headers=headers, timeout=1.0)[0] == 200
    except OSError:
        return False


def wait_health(
    child: Child, timeout: float, poll_s: float = 0.05, stop: threading.Event | None = None
) -> float:
    """Wait until the child's /health answers 200 (see `wait_until` for the failures)."""
    return wait_until(lambda: answers_health(child.url), timeout, child, poll_s, stop)
