"""When `radix-router up` restarts a child that exited, and when it gives up.

A local fleet is where a newcomer tries failover: killing a worker must show the router
routing around it and the worker coming back (a new epoch: an empty cache), not end the
whole fleet (issue 21). So a child that exits is restarted after a backoff that doubles
from `BASE_S` up to `CAP_S`; one that exits more than `MAX_RESTARTS` times within
`WINDOW_S` is not cured by restarting (a crash at start, a port taken), and `up` then
stops the fleet and exits 1, saying so.
"""

from __future__ import annotations

import signal
from collections import deque

MAX_RESTARTS = 5
WINDOW_S = 120.0
BASE_S = 1.0
CAP_S = 16.0


class Restarts:
    """Exit times per child name, and the backoff they call for."""

    def __init__(self, max_restarts: int = MAX_RESTARTS, window_s: float = WINDOW_S) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._exits: dict[str, deque[float]] = {}

    def on_exit(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting `name`, which exited at `now`; None when it
        exited more than `max_restarts` times within `window_s`: give up."""
        exits = self._exits.setdefault(name, deque())
        exits.append(now)
        while now - exits[0] > self.window_s:
            exits.popleft()
        if len(exits) > self.max_restarts:
            return None
        return min(CAP_S, BASE_S * 2 ** (len(exits) - 1))

    def recent(self, name: str) -> int:
        """Exits of `name` within the window, as last counted."""
        return len(self._exits.get(name, ()))


def describe_exit(returncode: int | None) -> str:
    """`exit status 1`, `killed by SIGKILL`."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
