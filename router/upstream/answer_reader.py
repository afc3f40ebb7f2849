"""The answer arriving on a worker connection: its bytes read into status, headers and body.

`AnswerReader` is the read side of `WorkerConnection` (router/upstream/connection.py,
which owns the socket, the waits and the reuse rule): `data_received` takes the worker's
bytes, and the answer in progress is its state (`_reset` before each request).

Two readers, one outcome. `httptools` (the llhttp C parser) frames every answer:
Content-Length, chunked, or a body that ends when the worker closes; its callbacks
below check and keep each piece. An answer of the simplest form that arrives whole in
one read is read by one pattern instead (`router/upstream/simple_answer.py`; a head that repeats the
connection's last one, but for the id and the length, not even by that), and
`_take_head` holds the checks both readers apply to a head (transfer coding, the echo
of the request id, type, length). `tests/router/upstream/test_simple_heads.py` feeds the
same bytes through both and compares every observable field.

The worker is a peer, not trusted code: anything that is not one well-framed answer to
the request sent (a parse error, bytes nobody asked for, a second answer, a header block
over `MAX_HEAD_BYTES`, a field over `MAX_FIELD_BYTES`, more than `MAX_HEADERS` lines, a
value that is not visible ASCII) breaks the connection (`_break`). Informational answers
(100, 103) are skipped as HTTP says; 101 is refused. A buffered answer over
`max_buffered` bytes stops being read at once (`too_big`), and all buffered answers
together hold at most the pool's `BufferBudget` (`over_budget`); a streamed one is read
as it is relayed, the socket paused while more than `HIGH_WATER` bytes wait.
"""

from __future__ import annotations

import asyncio

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from multidict import CIMultiDict

from router.upstream.limits import (
    BAD_VALUE,
    MAX_FIELD_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    BufferBudget,
    only_chunked,
)
from router.upstream.simple_answer import SimpleReader

HIGH_WATER = 262144  # streamed bytes held before the socket is paused


class _Garbage(Exception):
    pass


class _Foreign(_Garbage):
    """Bytes of another answer (limits.ForeignAnswer)."""


def _no_parser(data: bytes) -> None:
    raise HttpParserError("the connection is closed")


class AnswerReader(asyncio.Protocol):
    """The bytes of one answer at a time, read into its fields (the connection's read side)."""

    simple_heads = True  # a whole simple answer is read without the parser (False: always it)

    def __init__(self, max_buffered: int, budget: BufferBudget) -> None:
        self.max_buffered = max_buffered
        self.budget = budget
        self.transport: asyncio.Transport | None = None
        self.parser: HttpResponseParser | None = HttpResponseParser(self)
        self.feed = self.parser.feed_data
        self.error: str | None = None  # why the connection is broken; None while sound
        self.spoiled: str | None = None  # the worker sent what is not one answer
        self.foreign = False  # what broke it was another answer's bytes (ForeignAnswer)
        self.exchanges = 0  # answers started on this connection (0: fresh)
        self.request_id = ""  # the id sent with the current request
        self._simple = SimpleReader(MAX_FIELD_BYTES)  # (under the field cap no cap can differ)
        self._reset()

    def _reset(self) -> None:
        self.busy = False  # a request was sent and its answer is not read to its end
        self.got_bytes = False  # any byte of the current answer arrived
        self.status = 0
        self.headers: CIMultiDict[str] | None = None  # set when the head is complete
        self.content_type = ""
        self.content_length: int | None = None
        self._raw: list[tuple[str, str]] = []  # the parser's header lines so far
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

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self._break("the worker sent bytes nobody asked for")
            return
        if not self.got_bytes:  # the answer's first bytes: the parser is between messages
            self.got_bytes = True
            if self.simple_heads and self._take_simple(data):
                return
        try:
            self.feed(data)
        except HttpParserUpgrade:
            self._break("the worker switched protocols")
        except HttpParserError as e:  # bad framing, or a callback's _Garbage
            cause = e.__context__ if isinstance(e.__context__, _Garbage) else e
            self.foreign = self.foreign or isinstance(cause, _Foreign)
            self._break(f"the worker's answer is not HTTP/1.1: {cause}")

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

    def _take_simple(self, data: bytes) -> bool:
        """Take `data` when it is a whole answer of the simplest form
        (router/upstream/simple_answer.py) as the parser's callbacks would; False, nothing
        taken, for anything else. The parser saw none of it and stays between messages: a
        byte after the answer is a second answer to it, as before."""
        answer = self._simple.read(data, self.request_id)
        if answer is None:
            return False
        status, fields, length, body = answer
        try:
            self._take_head(status, fields, length)
        except _Garbage as cause:
            self.foreign = self.foreign or isinstance(cause, _Foreign)
            self._break(f"the worker's answer is not HTTP/1.1: {cause}")
            self._drop_parser()  # refuses what follows, as the parser after its error
            return True
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
        return True

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
        self.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
        self._wake()

    # --- what the reading does to the connection ----------------------------------

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
