"""One keep-alive HTTP/1.1 connection to a worker, and the answer arriving on it.

An `asyncio.Protocol` on the running loop (uvloop in production) with `httptools` (the
llhttp C parser) doing the framing: Content-Length, chunked, or a body that ends when
the worker closes. It replaced `aiohttp.ClientSession` on the inference path, which cost
~13% of the router's CPU per request in Python (py-spy, 2026-12-01; see
`loadtests/results/router_overhead.md`). An answer of the simplest form that arrives
whole in one read is read by one pattern instead, with the same outcome
(`router/upstream/simple_answer.py`).

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

Informational answers (100, 103) are skipped as HTTP says; 101 is refused. Header
names and values are capped like aiohttp's and values must be visible ASCII
(`router/upstream/limits.py`).

Deadlines: the head and a buffered body must arrive within `read_timeout` of the send
(one overall deadline: a trickle of one byte every few seconds is cut); a stream's
waits for bytes are bounded by `read_timeout` each, so a long, live stream is never cut.
A buffered answer over `max_buffered` bytes stops being read at once (`too_big`), and
all buffered answers together hold at most the pool's `BufferBudget` (`over_budget`); a
streamed one is read as it is relayed, the socket paused while more than `HIGH_WATER`
bytes wait. A broken connection drops its parser and buffers at once (the parser holds
the protocol as its callbacks: the cycle kept both, and the chunks, until a full GC).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from multidict import CIMultiDict

from router.upstream.limits import (
    BAD_VALUE,
    MAX_FIELD_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    BufferBudget,
    ForeignAnswer,
    UpstreamBroken,
    close_delimited,
    only_chunked,
)
from router.upstream.simple_answer import simple_answer

__all__ = ["BufferBudget", "UpstreamBroken", "WorkerConnection"]

HIGH_WATER = 262144  # streamed bytes held before the socket is paused


class _Garbage(Exception):
    pass


class _Foreign(_Garbage):
    """Bytes of another answer (limits.ForeignAnswer)."""


def _no_parser(data: bytes) -> None:
    raise HttpParserError("the connection is closed")


class WorkerConnection(asyncio.Protocol):
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
        self.max_buffered = max_buffered
        self.on_lost = on_lost
        self.budget = budget
        self.transport: asyncio.Transport | None = None
        self.parser = HttpResponseParser(self)
        self.feed = self.parser.feed_data
        self.error: str | None = None  # why the connection is broken; None while sound
        self.spoiled: str | None = None  # the worker sent what is not one answer
        self.foreign = False  # what broke it was another answer's bytes (ForeignAnswer)
        self.exchanges = 0  # answers started on this connection (0: fresh)
        self.idle_since = 0.0
        self.request_id = ""  # the id sent with the current request
        # One timer a connection, re-armed lazily (as router/http/fast_server.py's): a
        # wait sets `_due` and arms it only when none is pending; when it fires it
        # times the wait out, or re-arms for what is left. A timer per wait (armed and
        # cancelled) cost ~1 us per request (uvloop, timeit).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # loop time the pending timer fires at
        self._due = 0.0  # loop time the current wait times out at
        self._reset()

    def _reset(self) -> None:
        self.busy = False  # a request was sent and its answer is not read to its end
        self.got_bytes = False  # any byte of the current answer arrived
        self.status = 0
        self.headers: CIMultiDict[str] | None = None  # set when the head is complete
        self.content_type = ""
        self.content_length: int | None = None
        self._raw: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._lines = 0  # len(self._raw), without a call
        self._chunked = False
        self._cap: int | None = None  # buffered answers: max_buffered; streams: none
        self.too_big = False
        self.over_budget = False
        self.echoed = False  # the answer's x-request-id is the one sent
        self._informational = False  # a 1xx head is being skipped
        self._deadline: float | None = None  # head and buffered body: one overall deadline
        self._held = 0  # bytes counted in the budget
        self.complete = False  # the answer's last byte arrived
        self.keep_alive = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._size = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    simple_heads = True  # a whole simple answer is read without the parser (False: always it)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self._break("the worker sent bytes nobody asked for")
            return
        if not self.got_bytes:  # the answer's first bytes: the parser is between messages
            self.got_bytes = True
            if self.simple_heads:
                answer = simple_answer(data, MAX_FIELD_BYTES)
                if answer is not None:
                    self._take_simple(*answer)
                    return
        try:
            self.feed(data)
        except HttpParserUpgrade:
            self._break("the worker switched protocols")
        except HttpParserError as e:  # bad framing, or a callback's _Garbage
            cause = e.__context__ if isinstance(e.__context__, _Garbage) else e
            self.foreign = self.foreign or isinstance(cause, _Foreign)
            self._break(f"the worker's answer is not HTTP/1.1: {cause}")

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

    def _drop_parser(self) -> None:
        """Break the protocol <-> parser cycle now, not at the next full GC."""
        self.parser = None
        self.feed = _no_parser

    # --- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.headers is not None or self._head_bytes:
            raise _Foreign("a second answer to one request")

    def on_status(self, reason: bytes) -> None:
        self._head_bytes += len(reason)
        if self._head_bytes > MAX_FIELD_BYTES:
            raise _Garbage(f"status line over {MAX_FIELD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # llhttp may hand a field over in pieces; over the caps either way.
        n, v = len(name), len(value)
        self._head_bytes += n + v + 4
        if self._head_bytes > MAX_HEAD_BYTES or self._lines >= MAX_HEADERS:
            raise _Garbage(f"header block over {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} lines")
        if n > MAX_FIELD_BYTES or v > MAX_FIELD_BYTES:
            raise _Garbage(f"header field over {MAX_FIELD_BYTES} bytes")
        if BAD_VALUE.search(value) is not None:
            raise _Garbage("a header value that is not visible ASCII")
        if self.headers is None:  # trailers (after a chunked body) are read and dropped
            self._lines += 1
            self._raw.append((name.decode("ascii", "replace"), value.decode("ascii")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()  # type: ignore[union-attr]
        if 100 <= status < 200:
            if status == 101:
                raise _Garbage("the worker switched protocols")
            # Informational (100 Continue, 103 Early Hints): not the answer; skip it.
            self._informational = True
            self._raw = []
            self._head_bytes = 0
            self._lines = 0
            return
        self._take_head(status, self._raw)
        self._wake()

    def _take_head(
        self, status: int, raw: list[tuple[str, str]], length: int | None = None
    ) -> None:
        """The answer's head (not 1xx), parsed by httptools or `simple_answer`: its checks,
        then its fields (`_Garbage` when one fails). `length`: `simple_answer`'s, whose pattern
        admitted one Content-Length and no Transfer-Encoding (None: look them up)."""
        self.status = status
        # Set as the answer's head only once its checks pass: a head that broke one (an
        # echo of another request) was taken for the answer, its status 200 and no type.
        headers = CIMultiDict(raw)
        coding = None if length is not None else headers.getall("Transfer-Encoding", None)
        if coding is not None and not only_chunked(coding):
            # No TE was sent, so chunked is the only coding a worker may apply (once).
            raise _Garbage("a transfer coding other than chunked")
        echo = headers.get("x-request-id")
        if echo is not None and echo != self.request_id:
            raise _Foreign("an answer to another request (x-request-id differs)")
        if echo is None and self.exchanges > 1:
            raise _Foreign("no x-request-id echo on a reused connection")
        self.echoed = echo is not None
        self.headers = headers
        kind = headers.get("Content-Type", "")
        if kind != "application/json":  # (the common value is its own normal form)
            kind = kind.partition(";")[0].strip().lower()
        self.content_type = kind
        self._chunked = coding is not None
        if length is None:
            value = headers.get("Content-Length")
            if value is not None:
                length = int(value)  # llhttp accepted it: digits only
        self.content_length = length
        if kind != "text/event-stream":
            self._cap = self.max_buffered
        else:
            self._deadline = None  # a stream: each wait for bytes has its own timer

    def _take_simple(
        self, status: int, fields: list[tuple[str, str]], length: int, body: bytes
    ) -> None:
        """Take a whole answer of the simplest form (router/upstream/simple_answer.py) as the
        parser's callbacks would. The parser saw none of it and stays between messages:
        a byte after the answer is a second answer to it, as before."""
        try:
            self._take_head(status, fields, length)
        except _Garbage as cause:
            self.foreign = self.foreign or isinstance(cause, _Foreign)
            self._break(f"the worker's answer is not HTTP/1.1: {cause}")
            self._drop_parser()  # refuses what follows, as the parser after its error
            return
        if length:
            budget, cap = self.budget, self._cap
            if cap is not None and length <= cap and budget.used + length <= budget.limit:
                # `on_body` of a buffered answer within its caps, inlined (the common case)
                self._chunks = [body]
                self._size = self._buffered = self._held = length
                budget.used += length
                if budget.used > budget.peak:
                    budget.peak = budget.used
            else:
                self.on_body(body)
        self.complete = self.keep_alive = True
        waiter = self._waiter  # `_wake` inlined
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        n = len(body)
        self._size += n
        self._buffered += n
        if self._cap is not None:  # buffered: read whole, up to the cap
            budget = self.budget
            budget.used += n
            self._held += n
            if budget.used > budget.peak:
                budget.peak = budget.used
            if self._size > self._cap:
                self.too_big = True
                self._break(f"answer over {self._cap} bytes")
                return
            if budget.used > budget.limit:
                self.over_budget = True
                self._break(f"buffered answers over {budget.limit} bytes in all")
                return
        elif self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # --- the exchange -------------------------------------------------------------

    def _break(self, why: str) -> None:
        if self.error is None:
            self.error = why
        if self.spoiled is None:
            self.spoiled = why
        if self._cap is not None:  # a buffered answer's bytes are of no use now
            self._chunks = []
        self._give_back()
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _give_back(self) -> None:
        if self._held:
            self.budget.used -= self._held
            self._held = 0

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None  # one wake a wait: later events find none to wake
            if not waiter.done():  # (cancelled with its task)
                waiter.set_result(None)

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
