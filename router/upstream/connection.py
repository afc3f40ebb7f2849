"""One keep-alive HTTP/1.1 connection to a worker: the exchange, its waits and its reuse.

An `asyncio.Protocol` on the running loop (uvloop in production). How an answer's bytes
are read (httptools, or one pattern for the simplest answer) is its read side,
`AnswerReader` (router/upstream/answer_reader.py). It replaced `aiohttp.ClientSession` on
the inference path, which cost ~13% of the router's CPU per request in Python (py-spy,
2026-12-01; see `loadtests/results/router_overhead.md`).

A connection carries one exchange at a time, and the worker on the other end is a peer,
not trusted code. Anything that is not one well-framed answer to the request sent (a
parse error, bytes nobody asked for, a second answer, a header block over
`MAX_HEAD_BYTES`, a close mid-body) breaks the connection: it is aborted, the waiting
request gets `UpstreamBroken`, and the pool never hands it out again. Only a connection
whose answer was read to its end, and which the worker did not ask to close, goes back.

**Reuse only when provably idle** (issue 21: a worker that sent an unrequested second
answer 1-5 ms after the first had it read as the next client's answer). Silence proves
nothing: the late bytes may be on the wire when the connection is handed out again. So:

- every request carries its `x-request-id` (`router/upstream/proxy.py`), and a connection is not
  reused for a request whose id is the one it last carried (a client may send one id
  twice): a late copy of an answer then always echoes an id other than the one sent;
- an answer whose echo differs is an answer to another request: the connection is
  broken (`UpstreamBroken`, retried elsewhere), the answer never delivered;
- a connection goes back to the pool only after an answer that echoed the id sent, and
  an answer on a reused connection must echo it: a worker that does not echo (a stock
  engine) gets a fresh connection per request, whose first answer is provably its own;
- any byte after an answer is complete, or while the connection sits in the pool,
  breaks it (`data_received` when not busy, a second message begun).

Deadlines: the head and a buffered body must arrive within `read_timeout` of the send
(one overall deadline: a trickle of one byte every few seconds is cut); a stream's
waits for bytes are bounded by `read_timeout` each, so a long, live stream is never cut.
A broken connection drops its parser and buffers at once (the parser holds
the protocol as its callbacks: the cycle kept both, and the chunks, until a full GC).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from router.upstream.answer_reader import AnswerReader
from router.upstream.limits import BufferBudget, ForeignAnswer, UpstreamBroken, close_delimited

__all__ = ["BufferBudget", "UpstreamBroken", "WorkerConnection"]


class WorkerConnection(AnswerReader):
    """The protocol and the answer in progress on it (one at a time)."""

    def __init__(
        self,
        read_timeout: float,
        max_buffered: int,
        on_lost: Callable[[WorkerConnection], None],
        budget: BufferBudget,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.on_lost = on_lost
        self.idle_since = 0.0
        # One timer a connection, re-armed lazily (as router/http/fast_server.py's): a
        # wait sets `_due` and arms it only when none is pending; when it fires it
        # times the wait out, or re-arms for what is left. A timer per wait (armed and
        # cancelled) cost ~1 us per request (uvloop, timeit).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # loop time the pending timer fires at
        self._due = 0.0  # loop time the current wait times out at
        super().__init__(max_buffered, budget)

    # --- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def eof_received(self) -> bool:
        return False  # half-closed by the worker: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy and not self.complete and self.error is None:
            ends = close_delimited(self.status, self.content_length, self._chunked)
            if self.headers is not None and ends and exc is None:
                self.complete = True  # a body that ends with the connection (HTTP/1.0 style)
                self.keep_alive = False
            else:  # a reset is no end of a body: it was cut short
                self.error = "the worker closed the connection" + (f" ({exc})" if exc else "")
        elif self.error is None:
            self.error = "closed"
        self._drop_parser()
        self.transport = None  # the transport holds us too: no cycle left for a GC
        if self._timer is not None:  # (it holds us too)
            self._timer.cancel()
            self._timer = None
        self._wake()
        self.on_lost(self)

    def _waiter_until(self, due: float) -> asyncio.Future[None]:
        """A wait for bytes that times out at loop time `due` (the connection's timer)."""
        waiter = self._waiter = self.loop.create_future()
        self._due = due
        if self._timer is None or self._timer_at > due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            self._timer = self.loop.call_at(due, self._tick)
        return waiter

    def _tick(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # no wait pending: the next one arms the timer again
        left = self._due - self.loop.time()
        if left > 0.001:  # the wait began after the timer was armed: not due yet
            self._timer_at = self._due
            self._timer = self.loop.call_at(self._due, self._tick)
            return
        self._waiter = None
        waiter.set_exception(TimeoutError())

    async def _wait(self) -> None:
        now = self.loop.time()
        due = now + self.read_timeout
        if self._deadline is not None:
            due = min(due, self._deadline)
            if due <= now:
                raise TimeoutError
        try:
            await self._waiter_until(due)
        finally:
            self._waiter = None

    def start(self, data: bytes, request_id: str) -> asyncio.Future[None]:
        """Send one request; the future is done once bytes of its answer (usually the
        whole answer) arrived or the connection broke, or fails with TimeoutError at the
        exchange's deadline. `send` is the whole wait for the head: this future, then
        `until_head` while the head is not complete (a caller awaiting both directly
        saves a coroutine per exchange)."""
        self._reset()
        self.busy = True
        self.exchanges += 1
        self.request_id = request_id
        loop = self.loop
        # `_waiter_until` inlined: the head has the exchange's one overall deadline.
        due = self._deadline = self._due = loop.time() + self.read_timeout
        waiter = self._waiter = loop.create_future()
        if self._timer is None or self._timer_at > due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            self._timer = loop.call_at(due, self._tick)
        self.transport.write(data)  # type: ignore[union-attr]
        return waiter

    async def until_head(self) -> None:
        """Wait until the answer's head arrived (after `start`'s future)."""
        deadline = self._deadline
        loop = self.loop
        while self.headers is None:
            if self.error is not None:
                raise self._broken(self.error)
            if deadline <= loop.time():  # type: ignore[operator]
                raise TimeoutError
            try:
                await self._waiter_until(deadline)  # type: ignore[arg-type]
            finally:
                self._waiter = None

    async def send(self, data: bytes, request_id: str) -> None:
        """Send one request and wait for the head of its answer."""
        await self.start(data, request_id)
        if self.headers is None:
            await self.until_head()

    def _broken(self, why: str) -> UpstreamBroken:
        return ForeignAnswer(why) if self.foreign else UpstreamBroken(why)

    async def read_all(self) -> bytes:
        """The whole body (a buffered answer: `too_big` beyond `max_buffered`)."""
        while not self.complete:
            if self.error is not None:
                raise self._broken(self.error)
            await self._wait()
        if self.spoiled is not None:  # e.g. a 204 with a body: what followed is no answer
            raise self._broken(self.spoiled)
        return self.whole()  # type: ignore[return-value]

    def whole(self) -> bytes | None:
        """The whole body at once where it has all arrived and the answer is sound (what
        `read_all` returns then, taken the same way); None where `read_all` would wait or
        raise. The common buffered answer costs no coroutine."""
        if not self.complete or self.spoiled is not None:
            return None
        chunks = self._chunks
        self._chunks = []
        if self._held:  # (`_give_back` inlined)
            self.budget.used -= self._held
            self._held = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def readany(self) -> bytes:
        """What arrived since the last call, waiting if nothing did; b"" at the end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self._broken(self.error)
            await self._wait()
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def close_delimited(self) -> bool:
        return close_delimited(self.status, self.content_length, self._chunked)

    def is_eof(self) -> bool:
        return self.complete and not self._chunks

    def reusable(self) -> bool:
        """Read to its end, sound, not asked to close, and the answer echoed the id sent
        (silence does not prove a connection idle: see the module docstring)."""
        return (
            self.complete and self.keep_alive and self.echoed
            and self.error is None and not self._chunks
        )  # fmt: skip

    def close(self) -> None:
        if self.error is None:
            self.error = "closed by the router"
        self._chunks = []
        self._give_back()
        if self.transport is not None:
            self.transport.close()
