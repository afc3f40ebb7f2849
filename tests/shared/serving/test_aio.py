import asyncio

import pytest

from shared.serving.aio import reraise_if_cancelled


async def flaky_command() -> None:
    """Like redis-py: a cancellation that lands mid-command comes out as ConnectionError."""
    try:
        await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        raise ConnectionError("connection closed") from None


async def retry_loop(guarded: bool, stop: asyncio.Event | None = None) -> None:
    while stop is None or not stop.is_set():
        try:
            await flaky_command()
        except ConnectionError:
            if guarded:
                reraise_if_cancelled()
            await asyncio.sleep(0)


async def test_a_retry_loop_stops_when_cancelled() -> None:
    task = asyncio.create_task(retry_loop(guarded=True))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)


async def test_without_the_guard_the_loop_swallows_its_cancellation() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(retry_loop(guarded=False, stop=stop))
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.2)
    assert not done  # the hang this helper exists to prevent
    stop.set()
    await asyncio.wait([task], timeout=2)
    assert task.done()
