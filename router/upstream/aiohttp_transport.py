"""aiohttp's `ClientSession` behind the router's `Transport` interface (router/upstream/transport.py).

Selected with `upstream_client: aiohttp`. aiohttp frames the answers (its llhttp parser,
its limits: 8190-byte fields, 128 headers); this module adds what the router's own client
also does, so both pass one conformance suite:

- the request id's echo is checked on every answer (a differing echo is an answer to
  another request: `UpstreamBroken`); an answer without one has its connection marked
  `force_close`, so aiohttp's pool never hands it out again; an answer on a reused
  connection must echo (aiohttp reads bytes that arrived while a connection sat in its
  pool as the next answer: the echo is what catches them);
- a second answer that came with the first (pipelined extras, a 204 with a body) spoils
  the first: `UpstreamBroken`;
- header values must be ASCII (aiohttp decodes them as UTF-8);
- one overall deadline for the head and a buffered body; each wait of a stream is bounded
  by `sock_read`; `max_buffered` per answer and the shared `BufferBudget` across them.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver
from multidict import CIMultiDictProxy

from router.upstream.echo import EchoBook
from router.upstream.limits import (
    BAD_TEXT_VALUE,
    BufferBudget,
    ForeignAnswer,
    UpstreamBroken,
    close_delimited,
    only_chunked,
)

EVENT_STREAM = "text/event-stream"
_SENDING = contextvars.ContextVar[str]("upstream_request_id", default="")
_FRESH = contextvars.ContextVar[bool]("upstream_fresh", default=False)  # no pooled connection


def _dirty(proto: Any) -> bool:
    """Bytes arrived that no request asked for yet (parsed into aiohttp's queue, or
    not), or the connection failed: not provably idle."""
    return bool(proto._buffer or proto._tail or proto.exception() is not None)


class _IdleCheckingConnector(aiohttp.TCPConnector):
    """aiohttp's connector, but a pooled connection is handed out only when provably idle:
    its last answer echoed its request id, that id is not this request's, and no byte
    arrived since; otherwise it is closed and another taken (aiohttp would read those
    bytes as the next answer, and may pool a connection before the echo is checked)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # protocol -> the id its last answer echoed ("": it did not echo)
        self.last_id: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
        self.discarded = 0
        self.opened = 0

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        rid, fresh = _SENDING.get(), _FRESH.get()
        while True:
            conn = await super().connect(req, traces, timeout)
            proto = conn.protocol
            if proto is None:
                return conn
            last = self.last_id.get(proto)
            if last is None:  # a new connection
                self.opened += 1
                self.last_id[proto] = ""
                return conn
            if last and last != rid and not fresh and not _dirty(proto):
                return conn
            self.discarded += 1
            conn.close()


def _broken(e: BaseException) -> UpstreamBroken:
    return UpstreamBroken(f"{type(e).__name__}: {e}")


class AiohttpAnswer:
    """One answer from aiohttp's client, read under the transport's rules."""

    __slots__ = (
        "_deadline", "_held", "_proto", "budget", "close_delimited", "content_length",
        "content_type", "echoed", "headers", "max_buffered", "over_budget", "resp", "status",
        "too_big",
    )  # fmt: skip

    def __init__(
        self, resp: aiohttp.ClientResponse, deadline: float, max_buffered: int, budget: BufferBudget
    ) -> None:
        self.resp = resp
        self.status = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers
        ctype = resp.headers.get("Content-Type", "")
        self.content_type = ctype.partition(";")[0].strip().lower()
        length = resp.headers.get("Content-Length")
        self.content_length = int(length) if length is not None else None
        chunked = "chunked" in resp.headers.get("Transfer-Encoding", "").lower()
        self.close_delimited = close_delimited(resp.status, self.content_length, chunked)
        self.too_big = self.over_budget = False
        self.echoed = False
        self._deadline = deadline if self.content_type != EVENT_STREAM else None
        self.max_buffered = max_buffered
        self.budget = budget
        self._held = 0
        # The connection's protocol (private: aiohttp may already have released the
        # connection when a short answer arrived whole with its head).
        self._proto: Any = getattr(resp, "_protocol", None)

    def _spoiled(self) -> bool:
        """Bytes after the answer (a second answer, a 204's body) or a failure other than
        the clean close that ends a close-delimited body."""
        proto = self._proto
        if proto is None:
            return False
        error = proto.exception()
        if error is not None and not isinstance(error, aiohttp.ServerDisconnectedError):
            return True
        return bool(proto._buffer or proto._tail)

    async def read_all(self) -> bytes:
        chunks: list[bytes] = []
        size = 0
        budget = self.budget
        try:
            async with asyncio.timeout_at(self._deadline):
                while True:
                    chunk = await self.resp.content.readany()
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    budget.used += len(chunk)
                    self._held += len(chunk)
                    budget.peak = max(budget.peak, budget.used)
                    if size > self.max_buffered:
                        self.too_big = True
                        raise UpstreamBroken(f"answer over {self.max_buffered} bytes")
                    if budget.used > budget.limit:
                        self.over_budget = True
                        raise UpstreamBroken(f"buffered answers over {budget.limit} bytes in all")
        except TimeoutError:
            self.resp.close()
            raise TimeoutError from None
        except (aiohttp.ClientError, ValueError) as e:
            self.resp.close()
            raise _broken(e) from None
        except BaseException:
            self.resp.close()
            raise
        finally:
            budget.used -= self._held
            self._held = 0
        if self._spoiled():
            self.resp.close()
            raise ForeignAnswer("bytes after the answer: a second answer, or a body after no body")
        return b"".join(chunks)

    def whole(self) -> bytes | None:
        """Always None: aiohttp's body is read through `read_all` (its limits and checks)."""
        return None

    async def readany(self) -> bytes:
        try:
            return await self.resp.content.readany()
        except aiohttp.ClientError as e:
            if isinstance(e, asyncio.TimeoutError):
                raise TimeoutError from None
            raise _broken(e) from None

    def is_eof(self) -> bool:
        return self.resp.content.is_eof()

    def close(self) -> None:
        self.resp.close()


class AiohttpTransport:
    def __init__(
        self,
        resolver: AbstractResolver,
        connect_timeout: float,
        read_timeout: float,
        max_buffered: int,
        *,
        max_buffered_total: int | None = None,
        keepalive_s: float = 30.0,
    ) -> None:
        self.read_timeout = read_timeout
        self.max_buffered = max_buffered
        self.budget = BufferBudget(max_buffered_total or 4 * max_buffered)
        # Redirects are not followed, bodies not decompressed (identity is asked for).
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._resolver = resolver
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._connector: _IdleCheckingConnector | None = None
        self.echo = EchoBook()  # which workers echo request ids (router/upstream/echo.py)

    @property
    def stale_retries(self) -> int:
        """Pooled connections not handed out (not idle, or the same id): aiohttp retries
        a stale one itself, uncounted."""
        return self._connector.discarded if self._connector is not None else 0

    @property
    def connects(self) -> int:
        return self._connector.opened if self._connector is not None else 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = self._connector = _IdleCheckingConnector(
                limit=0, ttl_dns_cache=60, keepalive_timeout=self._keepalive_s,
                resolver=self._resolver,
            )  # fmt: skip
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",),
            )  # fmt: skip
        return self._session

    async def post(
        self, base_url: str, path: str, headers: list[tuple[str, str]], body: bytes,
        request_id: str, fresh: bool = False,
    ) -> AiohttpAnswer:  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        sent = [*headers, ("x-request-id", request_id), ("Accept-Encoding", "identity")]
        _SENDING.set(request_id)
        _FRESH.set(fresh)
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self._client().post(
                    base_url + path, data=body, headers=sent, allow_redirects=False
                )
        except aiohttp.ClientError as e:
            if isinstance(e, asyncio.TimeoutError) and not isinstance(
                e, aiohttp.ConnectionTimeoutError
            ):
                raise TimeoutError from None
            raise _broken(e) from None
        answer = AiohttpAnswer(resp, deadline, self.max_buffered, self.budget)
        proto = answer._proto
        last_id = self._connector.last_id  # type: ignore[union-attr]
        reused = proto is not None and bool(last_id.get(proto))
        echo = resp.headers.get("x-request-id")
        # Another answer's bytes (ForeignAnswer: the proxy resends once, fresh), else
        # what this answer itself is not allowed to be (the worker's failure).
        foreign = None
        if echo is not None and echo != request_id:
            foreign = "an answer to another request (x-request-id differs)"
        elif echo is None and reused:
            foreign = "no x-request-id echo on a reused connection"
        why = None
        if resp.status < 200:
            why = f"an answer with status {resp.status}"  # 1xx are skipped; 101 never asked
        elif any(BAD_TEXT_VALUE.search(v) for v in resp.headers.values()):
            why = "a header value that is not visible ASCII"
        elif (coding := resp.headers.getall("Transfer-Encoding", None)) is not None and (
            not only_chunked(coding)
        ):
            why = "a transfer coding other than chunked"
        if foreign is not None or why is not None:
            resp.close()
            raise ForeignAnswer(foreign) if foreign is not None else UpstreamBroken(why)
        answer.echoed = echo is not None
        self.echo.of(base_url).record(answer.echoed)
        if proto is not None:
            last_id[proto] = request_id if answer.echoed else ""
            if not answer.echoed:
                proto.force_close()  # aiohttp's pool closes it (if not pooled already)
        return answer

    def release(self, base_url: str, answer: AiohttpAnswer) -> None:
        if not answer.echoed:
            answer.resp.close()
        else:
            answer.resp.release()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
