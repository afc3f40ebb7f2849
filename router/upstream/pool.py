"""`UpstreamPool`: the router's HTTP/1.1 client for inference requests to workers.

Per worker (its base URL) a stack of idle keep-alive connections (`WorkerConnection`,
`router/upstream/connection.py`), the most recently used first, so a busy router reuses a
few warm sockets. Like the aiohttp connector it replaced (`limit=0`) it puts no cap on
connections in use: admission (`max_concurrent`) bounds them, and a pool limit would
queue requests invisibly. Idle connections are capped (`max_idle`, extra ones are
closed) and closed after `keepalive_s` unused.

What is sent: `POST <path> HTTP/1.1`, `Host`, the caller's header lines (already
allow-listed: `router/upstream/answers.py`), the exchange's `x-request-id`, `Accept-Encoding:
identity` (the body is relayed as it comes, so no compressed answer is asked for), and
the body with its Content-Length, in one write. Redirects are not followed: an answer
is an answer. A connection is reused only after an answer that echoed its request id
(`router/upstream/connection.py` says why silence is not enough).

A stale connection (the worker closed a keep-alive connection just as the request went
out, so not one byte of an answer came back) is not the worker's failure: the request
goes once more, on a fresh connection. `fresh=True` asks for a new connection outright
(the proxy's one resend after `ForeignAnswer`). Any other failure is raised: `UpstreamBroken`
(cannot connect, broken connection or framing) or `TimeoutError` (connect, or a wait for
bytes, over its timeout), for the proxy to classify.

Names resolve through the router's `GuardedResolver` (`router/upstream/resolver.py`) on every new
connection: a name cannot lead the router where a literal address could not. Health
checks, model probes, discovery and replica sync keep aiohttp's client: they are not
on the per-request path.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver

from router.upstream.connection import BufferBudget, UpstreamBroken, WorkerConnection
from router.upstream.echo import EchoBook, EchoStatus


class _Origin:
    """One worker's address and its idle connections."""

    __slots__ = ("echo", "heads", "host", "host_header", "idle", "literal", "port", "tls")

    def __init__(self, base_url: str, echo: EchoStatus) -> None:
        parts = urlsplit(base_url)
        self.echo = echo  # whether its answers echo the request id (router/upstream/echo.py)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = parts.scheme == "https"
        try:
            ipaddress.ip_address(self.host)
            self.literal = True
        except ValueError:
            self.literal = False
        # (path, *header lines) -> `POST <path> HTTP/1.1`, Host and the lines, as bytes:
        # built once, not per request (`head_of`).
        self.heads: dict[tuple[object, ...], bytes] = {}
        self.host_header = parts.netloc.encode("ascii")
        self.idle: list[WorkerConnection] = []

    def head_of(self, key: tuple[object, ...]) -> bytes:
        """The request head up to the request id for `key`, (path, *header lines)."""
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\n%s" % (
            key[0].encode("ascii"), self.host_header,  # type: ignore[attr-defined]
            "".join([f"{k}: {v}\r\n" for k, v in key[1:]]).encode(),  # type: ignore[misc]
        )  # fmt: skip
        # Most requests carry the same lines (a client's User-Agent, the worker key); a
        # line that changes per request (traceparent) leaves a few entries to be rebuilt.
        if len(head) <= MAX_KEPT_HEAD:
            if len(self.heads) >= MAX_KEPT_HEADS:
                self.heads.clear()
            self.heads[key] = head
        return head


MAX_KEPT_HEADS = 16  # request heads kept per worker
MAX_KEPT_HEAD = 1024  # bytes: a longer head is built each time (memory: 16 KB a worker)


class UpstreamPool:
    def __init__(
        self,
        resolver: AbstractResolver,
        connect_timeout: float,
        read_timeout: float,
        max_buffered: int,
        *,
        max_buffered_total: int | None = None,
        keepalive_s: float = 30.0,
        max_idle: int = 256,
    ) -> None:
        self.resolver = resolver
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_buffered = max_buffered
        self.budget = BufferBudget(max_buffered_total or 4 * max_buffered)
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._origins: dict[str, _Origin] = {}
        self._open: set[WorkerConnection] = set()
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.stale_retries = 0  # requests re-sent after a stale keep-alive connection
        self.connects = 0  # connections opened
        self.echo = EchoBook()  # which workers echo request ids (router/upstream/echo.py)

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = _Origin(base_url, self.echo.of(base_url))
        return origin

    async def post(
        self, base_url: str, path: str, headers: list[tuple[str, str]], body: bytes,
        request_id: str, fresh: bool = False,
    ) -> WorkerConnection:  # fmt: skip
        """Send the request; return the connection once the answer's head has arrived.
        The caller reads the body, then `release`s it (read to its end) or closes it."""
        origin = self._origins.get(base_url) or self._origin(base_url)
        key = (path, *headers)
        head = origin.heads.get(key) or origin.head_of(key)
        data = b"%sx-request-id: %s\r\nAccept-Encoding: identity\r\nContent-Length: %d\r\n\r\n%s" % (
            head, request_id.encode("ascii"), len(body), body,
        )  # fmt: skip
        idle = origin.idle
        while idle and not fresh:
            conn = idle.pop()
            if conn.error is not None or conn.transport is None or conn.transport.is_closing():
                continue
            if conn.request_id == request_id:
                # A late copy of the last answer would echo this id too (a client may
                # send one id twice): only a different id tells the two apart.
                conn.close()
                continue
            try:
                # `conn.send` inlined (a coroutine less per exchange): the answer is
                # usually whole when the start's future is done.
                await conn.start(data, request_id)
                if conn.headers is None:
                    await conn.until_head()
                # (`origin.echo.record(True)` inlined: a reused connection's answer echoed)
                echo = origin.echo
                echo.answers += 1
                echo.echoed_last = True
                return conn
            except UpstreamBroken:
                conn.close()
                if conn.got_bytes:
                    raise  # the worker answered, with garbage: its failure
                self.stale_retries += 1  # closed under us before one byte came back
                break
            except BaseException:
                conn.close()
                raise
        conn = await self._connect(origin)
        try:
            await conn.send(data, request_id)
        except BaseException:
            conn.close()
            raise
        origin.echo.record(conn.echoed)
        return conn

    def release(self, base_url: str, conn: WorkerConnection) -> None:
        """The answer was read to its end: keep the connection if it may carry another."""
        if not conn.reusable():
            conn.close()
            return
        origin = self._origins.get(base_url) or self._origin(base_url)
        if len(origin.idle) >= self.max_idle:
            conn.close()
            return
        conn.busy = False
        conn.idle_since = time.monotonic()
        origin.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(self.keepalive_s, self._sweep)

    async def _connect(self, origin: _Origin) -> WorkerConnection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                if origin.literal:
                    addresses = [(origin.host, origin.port)]
                else:
                    try:
                        found = await self.resolver.resolve(
                            origin.host, origin.port, socket.AF_UNSPEC
                        )
                    except OSError as e:
                        raise UpstreamBroken(f"cannot resolve {origin.host!r}: {e}") from None
                    addresses = [(r["host"], r["port"]) for r in found]
                last: OSError | None = None
                for host, port in addresses:
                    try:
                        _, conn = await loop.create_connection(
                            self._protocol, host, port, ssl=tls,
                            server_hostname=origin.host if tls is not None else None,
                        )  # fmt: skip
                    except OSError as e:
                        last = e
                        continue
                    self.connects += 1
                    self._open.add(conn)
                    return conn
                raise UpstreamBroken(f"cannot connect: {last}")
        except TimeoutError:
            # The worker's failure to accept, never the request's (not a read timeout).
            raise UpstreamBroken(f"cannot connect within {self.connect_timeout:g} s") from None

    def _protocol(self) -> WorkerConnection:
        return WorkerConnection(self.read_timeout, self.max_buffered, self._lost, self.budget)

    def _lost(self, conn: WorkerConnection) -> None:
        self._open.discard(conn)  # an idle one is skipped when next popped, or swept

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _sweep(self) -> None:
        """Close connections idle past `keepalive_s`; forget workers with none left."""
        self._sweeper = None
        deadline = time.monotonic() - self.keepalive_s
        for url, origin in list(self._origins.items()):
            keep = []
            for conn in origin.idle:
                if conn.error is None and conn.idle_since > deadline:
                    keep.append(conn)
                else:
                    conn.close()
            origin.idle = keep
            if not keep:
                del self._origins[url]
        if self._origins:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._open):
            conn.close()
        self._origins.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks
