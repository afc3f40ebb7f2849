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
