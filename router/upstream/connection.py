"""One keep-alive HTTP/1.1 connection to a worker, and the answer arriving on it.

An `asyncio.Protocol` on the running loop (uvloop in production) with `httptools` (the
llhttp C parser) doing the framing: Content-Length, chunked, or a body that ends when
the worker closes. It replaced `aiohttp.ClientSession` on the inference path, which cost
~13% of the router's CPU per request in Python (py-spy, 2026-12-01; see
`loadtests/results/router_overhead.md`).

A connection carries one exchange at a time, and the worker on the other end is a peer,
not trusted code. Anything that is not one well-framed answer to the request sent (a
parse error, bytes nobody asked for, a second answer, a header block over
`MAX_HEAD_BYTES`, a close mid-body) breaks the connection: it is aborted, the waiting
request gets `UpstreamBroken`, and the pool never hands it out again. Only a connection
whose answer was read to its end, and which the worker did not ask to close, goes back.

Waits for bytes (the head, then each wait for body) are bounded by `read_timeout`
(`TimeoutError`): a hung worker is caught without cutting a long, live stream. A buffered
answer over `max_buffered` bytes stops being read at once (`too_big`); a streamed one is
read as it is relayed, the socket paused while more than `HIGH_WATER` bytes wait.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from multidict import CIMultiDict

MAX_HEAD_BYTES = 65536  # status line and headers of one answer; beyond: a broken worker
MAX_HEADERS = 128
HIGH_WATER = 262144  # streamed bytes held before the socket is paused


class UpstreamBroken(Exception):
    """The connection failed, or the worker's bytes are not one well-framed answer."""


class _Garbage(Exception):
    pass


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class WorkerConnection(asyncio.Protocol):
    """The protocol and the answer in progress on it (one at a time)."""

    def __init__(
        self,
        read_timeout: float,
        max_buffered: int,
        on_lost: Callable[[WorkerConnection], None],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.max_buffered = max_buffered
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.parser = HttpResponseParser(self)
        self.error: str | None = None  # why the connection is broken; None while sound
        self.exchanges = 0  # answers started on this connection (0: fresh)
        self.idle_since = 0.0
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
        self._chunked = False
        self._cap: int | None = None  # buffered answers: max_buffered; streams: none
        self.too_big = False
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

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self._break("the worker sent bytes nobody asked for")
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except HttpParserUpgrade:
            self._break("the worker switched protocols")
        except HttpParserError as e:  # bad framing, or a callback's _Garbage
            cause = e.__context__ if isinstance(e.__context__, _Garbage) else e
            self._break(f"the worker's answer is not HTTP/1.1: {cause}")

    def eof_received(self) -> bool:
        return False  # half-closed by the worker: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy and not self.complete and self.error is None:
            if self.headers is not None and self.content_length is None and not self._chunked:
                self.complete = True  # a body that ends with the connection (HTTP/1.0 style)
                self.keep_alive = False
            else:
                self.error = "the worker closed the connection" + (f" ({exc})" if exc else "")
        elif self.error is None:
            self.error = "closed"
        self._wake()
        self.on_lost(self)

    # --- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.headers is not None or self._head_bytes:
            raise _Garbage("a second answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES or len(self._raw) >= MAX_HEADERS:
            raise _Garbage(f"header block over {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} lines")
        self._raw.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        headers = self.headers = CIMultiDict(self._raw)
        self.content_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        length = headers.get("Content-Length")
        if length is not None:
            self.content_length = int(length)  # llhttp accepted it: digits only
        if self.content_type != "text/event-stream":
            self._cap = self.max_buffered
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._size += len(body)
        self._buffered += len(body)
        if self._cap is not None:  # buffered: read whole, up to the cap
            if self._size > self._cap:
                self.too_big = True
                self._break(f"answer over {self._cap} bytes")
                return
        elif self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # --- the exchange -------------------------------------------------------------

    def _break(self, why: str) -> None:
        if self.error is None:
            self.error = why
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(self.read_timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def send(self, data: bytes) -> None:
        """Send one request and wait for the head of its answer."""
        self._reset()
        self.busy = True
        self.exchanges += 1
        self.transport.write(data)  # type: ignore[union-attr]
        while self.headers is None:
            if self.error is not None:
                raise UpstreamBroken(self.error)
            await self._wait()

    async def read_body(self) -> bytes:
        """The whole body (a buffered answer: `too_big` beyond `max_buffered`)."""
        while not self.complete:
            if self.error is not None:
                raise UpstreamBroken(self.error)
            await self._wait()
        chunks = self._chunks
        self._chunks = []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def readany(self) -> bytes:
        """What arrived since the last call, waiting if nothing did; b"" at the end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise UpstreamBroken(self.error)
            await self._wait()
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def is_eof(self) -> bool:
        return self.complete and not self._chunks

    def reusable(self) -> bool:
        """Read to its end, sound, and not asked to close: may carry another request."""
        return self.complete and self.keep_alive and self.error is None and not self._chunks

    def close(self) -> None:
        if self.error is None:
            self.error = "closed by the router"
        if self.transport is not None:
            self.transport.close()
