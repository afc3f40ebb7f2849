"""How engine outputs travel from the step thread to the event loop, and how the outputs
of one request that are ready together become one.

The step thread collects every output of a step into a `Delivery` (a list of
(mailbox, item) pairs) and hands it over with one `loop.call_soon_threadsafe`: one
wake-up of the loop per step, where a call per output woke it (a write to the loop's
self-pipe and a handle each) once per request per step. On the loop, `deliver` drops
each item into its request's `Mailbox`, which wakes the one task waiting on it.

A stream takes everything its mailbox holds at once (`Mailbox.take`); when the loop was
busy (writing other streams, a slow client), that is several steps' outputs. `coalesce`
merges those of one choice into one output, so the HTTP layer builds, encodes and writes
one delta for them, not one per step: the busier the loop, the cheaper each token. The
merged text, token ids and logprobs are the parts' concatenation; counts, `finished` and
`finish_reason` are the last part's, so what a client assembles (text, usage, finish)
is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator

from worker.engine.types import GenerateOutput

Item = GenerateOutput | BaseException


class Mailbox:
    """One request's outputs delivered and not yet taken; used on the event loop only."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Item]:
        """Every item delivered so far (waits for the first), oldest first."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


Delivery = list[tuple[Mailbox, Item]]


class RequestStream:
    """What `AsyncEngine.generate()` returns (the `OutputStream` of worker/engine/types.py):
    an async generator's outputs, so closing it early or cancelling a task waiting in it
    runs the generator's cleanup (an abort), plus `ready()`: whether the next output is
    there already, so the HTTP layer writes all outputs ready together at once. The
    generator pops `pending` (outputs taken from the mailbox, not yet yielded)."""

    def __init__(self, box: Mailbox, pending: deque[Item]) -> None:
        self._box, self._pending = box, pending
        self._gen: AsyncGenerator[GenerateOutput, None] | None = None

    def start(self, gen: AsyncGenerator[GenerateOutput, None]) -> RequestStream:
        self._gen = gen  # holds box and pending, never this object: no reference cycle
        return self

    def ready(self) -> bool:
        return bool(self._pending) or bool(self._box)

    def __aiter__(self) -> RequestStream:
        return self

    def __anext__(self) -> asyncio.Future[GenerateOutput]:
        assert self._gen is not None
        return self._gen.__anext__()  # type: ignore[return-value]

    async def aclose(self) -> None:
        assert self._gen is not None
        await self._gen.aclose()


def deliver(delivery: Delivery) -> None:
    for mailbox, item in delivery:
        mailbox.put(item)


def send(loop: asyncio.AbstractEventLoop, delivery: Delivery) -> None:
    """From the step thread: one hand-over for the whole delivery (nothing when empty)."""
    if not delivery:
        return
    # RuntimeError: the event loop is closed, nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(deliver, delivery)


def _merged(parts: list[GenerateOutput]) -> GenerateOutput:
    last = parts[-1]
    return GenerateOutput(
        request_id=last.request_id,
        text_delta="".join([p.text_delta for p in parts]),
        token_ids=tuple(t for p in parts for t in p.token_ids),
        prompt_tokens=last.prompt_tokens,
        cached_tokens=last.cached_tokens,
        completion_tokens=last.completion_tokens,
        finished=last.finished,
        finish_reason=last.finish_reason,
        index=last.index,
        logprobs=tuple(lp for p in parts for lp in p.logprobs),
        queue_seconds=last.queue_seconds,
    )


def coalesce(outputs: list[GenerateOutput]) -> list[GenerateOutput]:
    """One output per choice, in the order of each choice's first part."""
    if len(outputs) < 2:
        return outputs
    by_choice: dict[int, list[GenerateOutput]] = {}
    for out in outputs:
        by_choice.setdefault(out.index, []).append(out)
    return [parts[0] if len(parts) == 1 else _merged(parts) for parts in by_choice.values()]


def split(items: list[Item]) -> tuple[list[GenerateOutput], BaseException | None]:
    """The outputs before the first error, and that error (None if there is none): an
    error ends the stream, nothing after it is delivered."""
    for i, item in enumerate(items):
        if isinstance(item, BaseException):
            return items[:i], item  # type: ignore[return-value]
    return items, None  # type: ignore[return-value]
