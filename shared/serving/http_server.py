"""Listening for both services: a deadline on reading a request's head, and a bind that
fails fast.

aiohttp's server has no deadline on receiving a request's headers: a client that sends
half a header block and stops holds its connection (and a file descriptor) until the
keep-alive timeout, 3,630 s by default; 20,000 of them exhausted the router's file limit
and new clients were silently never served (issue 21). `HeaderDeadlineSite` wraps each
connection's aiohttp protocol in `_HeaderDeadline`, which closes the connection when a
request's head is not complete `header_read_timeout` seconds after the connection opened
or after the first byte of a later request on a kept-alive connection. An idle
kept-alive connection (no byte of a next request) is aiohttp's keep-alive timeout's
business: `KEEPALIVE_S`, like aiohttp's own `run_app` default, above the routers' 30 s
pool of idle worker connections (router/upstream/pool.py) so a worker never closes one
a router is about to reuse.

The wrapper reads three fields of aiohttp's RequestHandler (`_request_count`,
`_request_in_progress`, `_messages`): aiohttp offers no hook at "headers complete".
tests/shared/serving/test_http_server.py pins that behaviour with raw sockets.

`bind` turns a port that is taken into one error line (`BindError`) the CLIs exit 1 on.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

KEEPALIVE_S = 75.0  # idle kept-alive connection; see above


class BindError(RuntimeError):
    """The listening address could not be bound (taken, not local, no permission)."""


class _HeaderDeadline(asyncio.Protocol):
    """One connection: aiohttp's handler, closed when a request head is late."""

    __slots__ = ("_count", "_inner", "_timeout", "_timer")

    def __init__(self, inner: RequestHandler, timeout: float) -> None:
        self._inner = inner
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        self._count = 0  # request heads parsed when the timer was last settled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)
        self._arm()  # a client that connects and sends nothing is late too

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        inner.data_received(data)
        if inner._request_count != self._count:  # a head is complete: on time
            self._count = inner._request_count
            self._cancel()
        elif (
            data and self._timer is None and not inner._request_in_progress and not inner._messages
        ):
            self._arm()  # the first bytes of the next request's head

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _arm(self) -> None:
        self._cancel()
        self._timer = asyncio.get_running_loop().call_later(self._timeout, self._expire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        inner = self._inner
        if inner._request_count == self._count and not inner._request_in_progress:
            inner.force_close()


def deadline_protocol(server: web.Server, timeout: float) -> asyncio.Protocol:
    """One connection's protocol: aiohttp's, closed when a request head is late."""
    return _HeaderDeadline(server(), timeout)


# A protocol for each accepted connection, in place of `deadline_protocol`'s.
ProtocolFactory = Callable[[], asyncio.Protocol]


class HeaderDeadlineSite(web.TCPSite):
    """A TCP site whose connections get a request-head deadline (see the module), or
    `protocol`'s protocol (which keeps that deadline itself)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 header_read_timeout: float, reuse_port: bool = False,
                 protocol: ProtocolFactory | None = None) -> None:  # fmt: skip
        super().__init__(runner, host, port, reuse_port=reuse_port)
        self._header_read_timeout = header_read_timeout
        self._protocol = protocol

    async def start(self) -> None:
        # TCPSite.start, with the protocol factory wrapped; BaseSite.start registers it.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        timeout = self._header_read_timeout
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol or (lambda: deadline_protocol(server, timeout)),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


async def bind(runner: web.BaseRunner, host: str, port: int, *, header_read_timeout: float,
               reuse_port: bool = False, protocol: ProtocolFactory | None = None) -> HeaderDeadlineSite:  # fmt: skip
    """Listen on host:port; BindError (one line, the address in it) when that fails."""
    site = HeaderDeadlineSite(runner, host, port, header_read_timeout=header_read_timeout,
                              reuse_port=reuse_port, protocol=protocol)  # fmt: skip
    try:
        await site.start()
    except OSError as e:
        reason = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or e
        raise BindError(f"cannot listen on {host}:{port}: {reason}") from e
    return site
