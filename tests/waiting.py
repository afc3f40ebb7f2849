"""The one way async tests wait for something that happens on its own time (a poll loop,
another process, a socket): poll a check, fail the test instead of hanging.

Waiting for the *router's* time (a breaker cooldown, a discovery grace) is not done
here: those tests move the injected clock (`ManualClock`) instead of sleeping. The
blocking twin for threads and processes is `shared.procs.wait_until`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(
    check: Callable[[], bool], timeout: float = 5.0, every: float = 0.02, blocking: bool = False
) -> float:
    """Poll `check()` until true and return the seconds it took; AssertionError after
    `timeout`. `blocking`: the check does I/O, so it runs off the loop (a thread)."""
    start = time.monotonic()
    while not (await asyncio.to_thread(check) if blocking else check()):
        waited = time.monotonic() - start
        assert waited < timeout, f"condition not met within {timeout}s"
        await asyncio.sleep(every)
    return time.monotonic() - start


class ManualClock:
    """A clock for code that takes `clock: Callable[[], float]`: time moves only when the
    test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
