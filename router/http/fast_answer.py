"""The answers of the router's own protocol (router/http/fast_server.py), framed by the
router itself rather than by aiohttp's response objects and writer (`FastResponder`,
the own protocol's `Responder`: router/upstream/responder.py).

- A buffered answer (`FastReply`: the proxy's relayed JSON) leaves in ONE transport
  write, head and body together, framed by its `Content-Length`.
- A stream (`FastStream`) is HTTP chunked: its head leaves with its first chunk, each
  chunk framed as it is written, then the terminator. A write waits while the
  transport is paused (its buffer above the high-water mark), at most the stream write
  deadline: past it the connection is aborted and the write raises
  `ConnectionResetError`, as if the client had left (shared/serving/http.py
  `DeadlineStream`'s rule), so a client that never reads holds at most the transport's
  high-water mark and one chunk.
- An error answer of the edge or the handler (a plain `web.Response` with a bytes
  body, `shared/serving/errors.py`) is framed the same way; any other aiohttp response
  (a redirect, one with cookies, compression or chunking, or a status whose body must
  be empty: 1xx, 204, 304) is aiohttp's to write, through its own writer.

The header rules are aiohttp's (`web.StreamResponse._prepare_headers`), in its order:
the answer's own headers, then `Content-Length` (or `Transfer-Encoding: chunked`),
`Content-Type: application/octet-stream` where a body has none, `Date` (aiohttp's
once-a-second cached value), `Server`, `Connection: close` where the answer closes the
connection; then the apps' `on_response_prepare` hooks (the request id header, the
fleet queue's first byte) see the answer before its head is written. The head's bytes
are written by aiohttp's own serializer (`_serialize_headers`, its C one where aiohttp
is built with its extensions: 0.9 against the 1.1-1.4 us of our Python one, timeit), so
they are aiohttp's by construction: a name or value holding a control character (CR,
LF or any other but tab) is refused (ValueError). tests/router/http/test_hot_paths.py
compares the heads with aiohttp's, header by header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from shared.serving.http import DeadlineStream

# Every status line an answer may start with (its CRLF is the serializer's): built once.
_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}" for s in HTTPStatus}
_EMPTY = frozenset({204, 304})  # with 1xx: no body may follow (aiohttp drops it)


def _status_line(status: int, reason: str | None = None) -> str:
    if reason is None:
        line = _LINES.get(status)
        if line is not None:
            return line
        reason = ""
    return f"HTTP/1.1 {status} {reason}"


def _framed(headers: CIMultiDict[str], length: int, keep_alive: bool) -> None:
    """aiohttp's rules for a body of `length` bytes (the hooks run after this)."""
    headers.setdefault("Content-Length", str(length))
    if length:
        headers.setdefault("Content-Type", "application/octet-stream")
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    if not keep_alive:
        headers.setdefault("Connection", "close")


class HeadHook:
    """An `on_response_prepare` receiver whose work is one plain call (`now`): aiohttp
    awaits the receiver, the own protocol calls `now` itself (router/http/fast_server.py
    `FastServer` reads an app's receivers once: where every one is a HeadHook, an answer
    runs theirs with no coroutine made per hook)."""

    __slots__ = ("now",)

    def __init__(self, now: Callable[[Any, Any], None]) -> None:
        self.now = now

    async def __call__(self, request: Any, response: Any) -> None:
        self.now(request, response)


def now_hooks(hooks: tuple[Any, ...]) -> tuple[Callable[[Any, Any], None], ...] | None:
    """The plain calls of `hooks` where every one is a `HeadHook`, else None (then they
    are awaited, as aiohttp does)."""
    if all(type(hook) is HeadHook for hook in hooks):
        return tuple(hook.now for hook in hooks)
    return None


class FastReply:
    """A buffered answer of the proxy, written once the edge is done with it."""

    __slots__ = ("body", "headers", "status")
    keep_alive = True

    def __init__(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class FastStream:
    """A streamed answer, framed HTTP chunked (the module's rules)."""

    __slots__ = ("_head", "_protocol", "_timeout", "ended", "headers", "keep_alive", "status")

    def __init__(
        self, protocol: BaseProtocol, status: int, headers: CIMultiDict[str], write_timeout: float
    ) -> None:
        self._protocol, self._timeout = protocol, write_timeout
        self.status, self.headers = status, headers
        # None until prepared; then the head, until it leaves with the first chunk; then b"".
        self._head: bytes | None = None
        self.ended = False
        self.keep_alive = True

    async def prepare(self, request: Any) -> None:
        if self._head is not None or self.ended:
            return
        headers = self.headers
        headers["Transfer-Encoding"] = "chunked"
        headers.setdefault("Content-Type", "application/octet-stream")
        if "Date" not in headers:
            headers["Date"] = rfc822_formatted_time()
        headers.setdefault("Server", SERVER_SOFTWARE)
        await request._prepare_hook(self)
        self._head = _serialize_headers(_status_line(self.status), headers)

    async def write(self, data: bytes) -> None:
        if data:  # an empty chunk would end the stream
            await self._send(b"%x\r\n%s\r\n" % (len(data), data))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        await self._send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")

    async def _send(self, out: bytes) -> None:
        head = self._head
        if head:
            self._head, out = b"", head + out
        elif head is None:
            raise RuntimeError("a stream written before it was prepared")
        protocol = self._protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            self.keep_alive = False
            raise ConnectionResetError("the client is gone")
        transport.write(out)
        if protocol._paused:  # above the high-water mark: wait, within the deadline
            try:
                async with asyncio.timeout(self._timeout):
                    await protocol._drain_helper()
            except TimeoutError:
                self.keep_alive = False
                transport.abort()
                raise ConnectionResetError(
                    "the client did not read within the stream write timeout"
                ) from None


class FastResponder:
    """The own protocol's `Responder`, and the writer of whatever the edge answered
    (`finish`). It holds nothing: a request carries its connection (`request.protocol`,
    router/http/fast_server.py `FastRequest`), so one serves every connection."""

    __slots__ = ()

    def answer(
        self, status: int, headers: CIMultiDict[str], body: bytes
    ) -> FastReply | web.Response:
        if status < 200 or status in _EMPTY:  # aiohttp's rules for an empty body
            return web.Response(body=body, status=status, headers=headers)
        return FastReply(status, headers, body)

    def stream(
        self, request: Any, status: int, headers: CIMultiDict[str], write_timeout: float
    ) -> FastStream | DeadlineStream:
        if status < 200 or status in _EMPTY:
            return DeadlineStream(request, write_timeout, status=status, headers=headers)
        return FastStream(request.protocol, status, headers, write_timeout)

    async def finish(self, request: Any, response: Any) -> bool:
        """Write `response` (what the edge answered) unless written already; whether the
        connection stays open after it."""
        kind = type(response)
        if kind is FastReply:
            if request.now_hooks is not None:
                reply_now(request, response)
            else:
                await _whole(request, response, _status_line(response.status), response.body)
            return True
        if kind is FastStream:
            await response.write_eof()  # ended already, unless the client left mid-way
            return response.keep_alive  # type: ignore[no-any-return]
        if kind is web.Response and _plain(response):
            keep = response.keep_alive is not False
            line = _status_line(response.status, response.reason)
            await _whole(request, response, line, response.body, keep)
            return keep
        await response.prepare(request)  # aiohttp's own writer
        await response.write_eof()
        return response.keep_alive is not False  # type: ignore[no-any-return]


FAST = FastResponder()


def reply_now(request: Any, reply: FastReply) -> None:
    """A buffered answer of the proxy where every hook is a plain call (`now_hooks`):
    `_whole`'s steps, in its order, with no coroutine (the common answer)."""
    headers, body = reply.headers, reply.body
    # `_framed(headers, len(body), True)`, inlined: one call less per answer.
    headers.setdefault("Content-Length", str(len(body)))
    if body:
        headers.setdefault("Content-Type", "application/octet-stream")
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    for hook in request.now_hooks:
        hook(request, reply)
    transport = request.protocol.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client is gone")
    status = reply.status
    line = _LINES.get(status) or _status_line(status)
    transport.write(_serialize_headers(line, headers) + body)


async def _whole(request: Any, response: Any, line: str, body: bytes, keep: bool = True) -> None:
    """A buffered answer: the hooks see it, then head and body leave in one write."""
    headers = response.headers
    _framed(headers, len(body), keep)
    now = request.now_hooks
    if now is not None:
        for hook in now:
            hook(request, response)
    else:
        for hook in request.hooks:  # `_prepare_hook`'s loop: one coroutine less per answer
            await hook(request, response)
    transport = request.protocol.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client is gone")
    transport.write(_serialize_headers(line, headers) + body)


def _plain(response: web.Response) -> bool:
    """An aiohttp answer the module frames itself: a bytes body and nothing else."""
    status = response.status
    return (
        isinstance(response.body, bytes) and status >= 200 and status not in _EMPTY
        and not response.chunked and not response.compression and not response.cookies
    )  # fmt: skip
