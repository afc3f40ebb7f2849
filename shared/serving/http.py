"""HTTP pieces both services use, defined once: paths, content types, the SSE response
classes."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

# Endpoints that run inference: rate-limited by the router, counted in flight and
# refused while draining by the worker.
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})

EVENT_STREAM = "text/event-stream"


def request_key(name: str) -> Any:
    """A key for a value kept in an aiohttp request's dict: `web.RequestKey` where aiohttp
    has it (3.13 and later warn on plain strings: NotAppKeyWarning), else the name."""
    key_type = getattr(web, "RequestKey", None)
    return key_type(name, str) if key_type else name


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class EventStreamResponse(web.StreamResponse):
    """A stream whose status line and headers go out with its first chunk, in one write.

    aiohttp's own `web.Response` works this way (the class attribute below); a plain
    `StreamResponse` sends the headers alone at `prepare()`, one more socket write (and
    wake-up of the client) per stream. Callers write their first chunk right after
    `prepare()`, so the headers are never held back.
    """

    _send_headers_immediately = False


# A write that leaves less than this in the transport's buffer cannot wait (the
# transport pauses its writer only above its high-water mark, 64 KiB by default), so it
# needs no deadline; an asyncio.timeout per chunk would cost a timer handle each.
_UNGUARDED_BYTES = 16384


class DeadlineStream(EventStreamResponse):
    """An event stream whose every write must be taken within `write_timeout` seconds.

    A client that stops reading makes a write wait for as long as it stays connected,
    and with it whatever the stream holds (a router's slot, a worker's engine slot and
    KV). Past the deadline the connection is aborted and ConnectionResetError raised,
    as if the client had left, so the caller's cleanup for a departed client runs.
    """

    def __init__(self, request: web.Request, write_timeout: float, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._transport = request.transport
        self._write_timeout = write_timeout

    def _may_wait(self, size: int) -> bool:
        transport = self._transport
        return transport is None or transport.get_write_buffer_size() + size > _UNGUARDED_BYTES

    def _stalled(self) -> ConnectionResetError:
        if self._transport is not None:
            self._transport.abort()
        return ConnectionResetError("the client did not read within the stream write timeout")

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._may_wait(len(data)):
            return await super().write(data)
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write(data)
        except TimeoutError:
            raise self._stalled() from None

    async def write_eof(self, data: bytes = b"") -> None:
        if not self._may_wait(len(data)):
            return await super().write_eof(data)
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write_eof(data)
        except TimeoutError:
            raise self._stalled() from None
