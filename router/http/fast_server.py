"""A listening protocol that serves the simplest inference requests itself and hands
every other connection to aiohttp (config `fast_hot_paths`, on by default: about 10%
less CPU a request, loadtests/results/router_cpu.md).

A request is served here only when it is, whole, in what the connection has read:
`POST /v1/chat/completions` or `POST /v1/completions` (that exact target), HTTP/1.1,
one `Content-Length` no larger than `max_body_bytes`, a `Host`, no `Transfer-Encoding`,
`Expect`, `Upgrade`, `Content-Encoding`, `TE` or `Trailer`, `Connection` absent or
`keep-alive`, a head of at most 8190 bytes and 128 headers (so within aiohttp's limits),
and nothing after it (no pipelined request begun). One strict pattern checks the head
(router/http/fast_head.py, which also keeps a connection's last head: the same head
again is not read again); the edge and the route's handler run as for the hot paths
(router/http/edge.py), on a request object that carries what they read
(`FastRequest`), and the router frames the answer itself (router/http/fast_answer.py:
one write for a buffered answer, HTTP chunked for a stream, aiohttp's header rules).

Anything else (a request split across reads, a head the pattern refuses, any other
route, method, version or header) hands the connection over: aiohttp's protocol (with the head
deadline of shared/serving/http_server.py) takes the transport (`set_protocol`) and is
fed the current request's bytes from their first, and the connection stays aiohttp's.
A hand-over never happens while a fast answer is being written: bytes that arrive
then wait until it is done. tests/router/http/test_server_conformance.py holds both
ways to one table.

A connection's fast requests are answered by one task, made by its first and ended with
the connection (closed, handed over, or left by its client, which cancels the answer in
flight: 499, as aiohttp's handler_cancellation): between requests it waits on a future
the next request resolves. A Task a request cost more (its creation, asyncio's WeakSet
add and discard: loadtests/results/router_cpu.md, "Eleventh pass: the connection").

aiohttp's server lists only its own connections, so at shutdown `FastServer.close()`
(router/http/app.py `stop_serving`, before `runner.cleanup()`) closes these: idle ones at
once, one being answered when its answer is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import HttpVersion11, StreamWriter
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from multidict import CIMultiDictProxy

from router.http.edge import Edge, hot_routes
from router.http.fast_answer import FAST, FastReply, now_hooks, reply_now
from router.http.fast_head import MAX_HEAD, LastHead
from router.upstream.responder import RESPONDER
from shared.serving.access_log import REQUEST_ID, REQUEST_ID_HEADER, log_access, request_id_of
from shared.serving.body import WHOLE_BODY
from shared.serving.errors import Handler, error_response_for
from shared.serving.http_server import KEEPALIVE_S, deadline_protocol

log = logging.getLogger(__name__)

MAX_PENDING = 65536  # bytes read during an answer before reading pauses


class _Content:
    """`request.content` for a body that came whole (shared/serving/body.py reads it where
    a handler reads the stream; the hot paths' handlers take `WHOLE_BODY` instead)."""

    __slots__ = ("_body",)

    def __init__(self, body: bytes) -> None:
        self._body = body

    def is_eof(self) -> bool:
        return True

    async def readexactly(self, n: int) -> bytes:
        assert n == len(self._body)
        return self._body


class FastRequest(dict[str, Any]):
    """What the edge, the inference handler and the answers (the own ones, and aiohttp's
    where one is aiohttp's to write) read of a request. It names the own protocol's
    responder (`RESPONDER`: router/upstream/responder.py), through which the proxy
    answers, and its connection (`protocol`), where the answer goes.

    A request is made by its route's subclass (`route_request_class`): what is the same for
    every request of a route (its path, handler, match, app and hooks) is the subclass's,
    so a request sets only its own (headers, body, connection; the writer of an answer
    aiohttp writes, made where one is)."""

    __slots__ = ("_writer", "headers", "protocol")
    method = "POST"
    version = HttpVersion11
    keep_alive = True
    # The route's, set by `route_request_class`.
    path: str
    handler: Handler
    app: web.Application
    _match_info: UrlMappingMatchInfo
    # The apps' on_response_prepare receivers (read once: the app is frozen by then), and
    # their plain-call twins where every one has one (`now_hooks`, router/http/fast_answer.py).
    hooks: tuple[Callable[..., Any], ...]
    now_hooks: tuple[Callable[[Any, Any], None], ...] | None

    def __init__(self, headers: CIMultiDictProxy[str], body: bytes, protocol: FastProtocol) -> None:
        self[RESPONDER] = FAST
        # The body came whole with the head: the handler takes it as it is (no read).
        self[WHOLE_BODY] = body
        self.headers = headers
        self.protocol = protocol  # its connection: where the answer goes
        self._writer: StreamWriter | None = None

    @property
    def _payload_writer(self) -> StreamWriter:
        # aiohttp's writer, made only for an answer aiohttp writes (fast_answer.py).
        if self._writer is None:
            self._writer = StreamWriter(self.protocol, self.protocol._loop)
        return self._writer

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.protocol.transport  # type: ignore[return-value]  # as aiohttp's

    @property
    def content_length(self) -> int:
        return len(self[WHOLE_BODY])

    @property
    def content(self) -> _Content:
        return _Content(self[WHOLE_BODY])

    @property
    def raw_path(self) -> str:
        return self.path

    @property
    def match_info(self) -> UrlMappingMatchInfo:
        return self._match_info

    @property
    def remote(self) -> str | None:
        transport = self.protocol.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return peer[0] if isinstance(peer, (list, tuple)) else None

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        # aiohttp's `Request._prepare_hook`: the apps' on_response_prepare receivers.
        now = self.now_hooks
        if now is not None:
            for call in now:
                call(self, response)
            return
        for hook in self.hooks:
            await hook(self, response)


def route_request_class(
    path: str, handler: Handler, match: UrlMappingMatchInfo, hooks: tuple[Callable[..., Any], ...]
) -> type[FastRequest]:
    """The requests of one hot route: a `FastRequest` whose class holds the route's part."""
    route = {"__slots__": (), "path": path, "handler": staticmethod(handler),
             "_match_info": match, "app": match.current_app, "hooks": hooks,
             "now_hooks": now_hooks(hooks)}  # fmt: skip
    return type(f"FastRequest[{path}]", (FastRequest,), route)


class FastProtocol(BaseProtocol):
    """One connection: fast answers while its requests are simple, aiohttp's after."""

    def __init__(self, server: FastServer) -> None:
        super().__init__(asyncio.get_running_loop())
        self._server = server
        self._hot, self._log, self._guard = server.hot, server.log, server.guard
        self._max_body, self._keepalive = server.max_body, KEEPALIVE_S
        self._pending = bytearray()  # read while a fast answer was being written
        # The last head taken: the same again is not read again (router/http/fast_head.py).
        self._last = LastHead()
        self._busy = False  # an answer is being made or written
        # The connection's task (the module's docstring) and the future it waits on for
        # the next request (None while an answer is being made).
        self._serving: asyncio.Task[None] | None = None
        self._next: asyncio.Future[FastRequest | None] | None = None
        # One timer a connection, re-armed lazily: it closes the connection once it has
        # been idle `_limit` seconds (the head deadline until a first answer, then
        # aiohttp's keep-alive timeout), not a timer handle per request.
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since = self._loop.time()
        self._limit = server.head_timeout

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server.connections.add(self)
        self._arm(self._limit)  # a client that sends nothing is late too

    def data_received(self, data: bytes) -> None:
        """`data` holds exactly one simple request: answer it; else hand over. Bytes that
        come while an answer is being written wait for it (`_pending`)."""
        if self._busy:  # a fast answer is being written: wait for it
            self._pending += data
            if len(self._pending) > MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()  # resumed when the answer is written
            return
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > MAX_HEAD:
            return self._hand_over(data)
        head, last = data[: end + 2], self._last
        found = last.found if head == last.head else last.take(head, self._max_body)
        if found is None:
            return self._hand_over(data)
        path, headers, size = found
        if end + 4 + size != len(data):  # split, or more after it
            return self._hand_over(data)
        request = self._hot[path](headers, data[end + 4 :], self)
        self._busy = True
        waiter = self._next
        if waiter is None:  # the connection's first fast request
            self._serving = self._loop.create_task(self._serve(request))
        else:
            self._next = None
            waiter.set_result(request)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._server.connections.discard(self)
        super().connection_lost(exc)
        if self._serving is not None:
            # The client left: its answer is cancelled, as by aiohttp's
            # handler_cancellation; an idle connection's task just ends.
            self._serving.cancel()

    # -- the connection's course
    async def _serve(self, request: FastRequest | None) -> None:
        """The connection's task: each fast request's edge, then its answer's write, then
        the next request (`_next`), until the connection closes or is handed over.

        The edge is `serve_logged`'s steps in its order (shared/serving/access_log.py: the
        id and start time; the guard and the handler, what either raises becomes
        `error_response_for`'s answer; then `on_done` and the access-log line, before the
        write), inlined: one coroutine a request less. tests/router/http/test_hot_paths.py
        holds it to the app's way."""
        loop, server, access = self._loop, self._server, self._log
        on_done, logs = access.on_done, access.enabled  # the config's: fixed while serving
        while request is not None:
            keep = False
            try:
                request[REQUEST_ID] = request_id_of(request.headers.get(REQUEST_ID_HEADER))
                start = perf_counter()
                status, response, answer = 500, None, None
                try:
                    try:
                        guard = self._guard
                        if guard is not None:
                            pending = guard(request)
                            if pending is not None:
                                await pending
                        response = await request.handler(request)
                    except Exception as e:
                        response = error_response_for(request, e)
                        if response is None:
                            if not isinstance(e, web.HTTPException):
                                raise
                            status = e.status
                            answer = e  # what the edge lets through (a redirect): aiohttp sends it
                    if response is not None:
                        status = response.status
                        answer = response
                except asyncio.CancelledError:
                    status = 499  # the client went away first (nginx's convention)
                    raise
                finally:
                    seconds = perf_counter() - start
                    if on_done is not None:
                        on_done(request, status, seconds, response)  # type: ignore[arg-type]
                    if logs and access.logger.isEnabledFor(logging.INFO):
                        log_access(access.logger, access.fields, request, status, seconds, response)  # type: ignore[arg-type]
                if type(answer) is FastReply and request.now_hooks is not None:
                    reply_now(request, answer)  # the common answer: no coroutine
                    keep = True
                else:
                    keep = await FAST.finish(request, answer)
            except (ConnectionError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("error answering %s", request.path)
            # Nothing of this request is kept while the connection waits for its next one.
            self._busy, request = False, None
            response = answer = None
            transport = self.transport
            if transport is None:  # the client left (and cancelled this task)
                return
            if not keep or server.closing:  # (a cancelled answer is not kept either)
                transport.close()
                return
            self._idle_since, self._limit = loop.time(), self._keepalive
            self._next = waiter = loop.create_future()
            if self._pending:  # read while answering (rare: clients wait for an answer)
                pending, self._pending = bytes(self._pending), bytearray()
                if len(pending) > MAX_PENDING:
                    transport.resume_reading()
                self.data_received(pending)  # answers `waiter`
            elif self._timer is None:
                self._arm(self._limit)
            request = await waiter  # None: the connection was handed over

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's protocol takes the connection and `data`, the current request's bytes."""
        self._disarm()
        self._server.connections.discard(self)  # aiohttp's from now on: its server's list
        waiter, self._next = self._next, None
        if waiter is not None:  # the connection's task ends
            waiter.set_result(None)
        transport = self.transport
        if transport is None:
            return
        inner = self._server.fallback()
        transport.set_protocol(inner)
        inner.connection_made(transport)
        if self._paused:  # the transport will tell the new protocol when to go on
            inner.pause_writing()
        self.transport = None
        if data:
            inner.data_received(data)

    def close_when_idle(self) -> None:
        """Close now if no answer is being written, else once it is (`FastServer.closing`)."""
        if not self._busy and self.transport is not None:
            self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._timer = self._loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        left = self._limit - (self._loop.time() - self._idle_since)
        if self._busy or left > 0.001:  # busy, or not idle that long yet
            self._arm(self._limit if self._busy else left)
        else:
            self.transport.close()


class FastServer:
    """Each accepted connection's protocol (`bind(protocol=...)`, a `ProtocolFactory`) for
    a set-up runner, and the connections it serves itself. aiohttp's server does not know
    those (a connection joins its list only when handed over), so `runner.cleanup()` does
    not close them: `close()` does, before it (router/http/app.py `serve`)."""

    def __init__(
        self, runner: web.AppRunner, edge: Edge, max_body: int, head_timeout: float
    ) -> None:
        server = runner.server
        assert server is not None, "FastServer needs a runner that is set up"
        self._aiohttp = server
        # Each hot route's requests; its apps' on_response_prepare receivers read once:
        # the app is frozen by now.
        self.hot: dict[str, type[FastRequest]] = {}
        for path, (handler, match) in hot_routes(runner.app).items():
            hooks = tuple(h for app in match.apps for h in app.on_response_prepare)
            self.hot[path] = route_request_class(path, handler, match, hooks)
        # The hot paths' guard: None where they need no key and no rate limit (edge.py).
        self.log, self.guard = edge.log, edge.hot_guard
        self.max_body, self.head_timeout = max_body, head_timeout
        self.connections: set[FastProtocol] = set()
        self.closing = False

    def __call__(self) -> asyncio.Protocol:
        # Closing: a connection accepted late is aiohttp's, whose shutdown closes it.
        return self.fallback() if self.closing else FastProtocol(self)

    def fallback(self) -> asyncio.Protocol:
        """aiohttp's protocol for one connection, with the head deadline."""
        return deadline_protocol(self._aiohttp, self.head_timeout)

    def close(self) -> None:
        """Shutting down: idle connections close now, busy ones once their answer is
        written; connections accepted from now on are aiohttp's."""
        self.closing = True
        for connection in list(self.connections):
            connection.close_when_idle()
