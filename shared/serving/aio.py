"""asyncio helpers shared by the services' background loops."""

from __future__ import annotations

import asyncio


def reraise_if_cancelled() -> None:
    """Re-raise a cancellation that a library turned into another exception.

    redis-py turns a `CancelledError` that lands mid-command into a `ConnectionError`.
    A retry loop that catches Redis errors would then swallow its own cancellation and
    spin on, and whoever awaits the task (app shutdown) would hang. Call this first in
    such `except` blocks.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[None], timeout: float = 5.0) -> None:
    """Cancel `task` and wait for it, but never longer than `timeout`.

    Cancellation alone is not a reliable stop for loops around redis-py: Python 3.11's
    `asyncio.timeout` can lose a cancel that arrives as its own deadline expires (it
    becomes a TimeoutError the library swallows). Loops therefore also check a stop flag
    their owner sets first; this bound keeps a shutdown from hanging either way.
    """
    task.cancel()
    await asyncio.wait([task], timeout=timeout)
