"""Server-sent events the way OpenAI streams: one `data:` line per chunk, then `[DONE]`.

Every event that is ready goes out at once (aiohttp's server sockets have TCP_NODELAY
set, so nothing waits for the next token), but events ready *together* leave in one
socket write: the status line and headers with the first events, the first output's
chunks (chat's role chunk and its first delta) together, and the last delta with the
usage chunk, `[DONE]` and the end of the chunked body. A write is a syscall plus a
wake-up of the reader, the largest single cost of streaming at small per-token work.

A write the client does not take within `stream_write_timeout` aborts the connection
and raises ConnectionResetError, as a client that left does: the handler then closes
the engine stream, which frees the request's slot and KV (a client that never read held
both for as long as it stayed connected).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from shared.http import EVENT_STREAM, EventStreamResponse

SSE_HEADERS = {
    "Content-Type": EVENT_STREAM,
    "Cache-Control": "no-cache",
    # Tells nginx-style proxies in front of the worker not to buffer the stream.
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"
_compact = json.JSONEncoder(separators=(",", ":")).encode  # built once, not per event


def encode_event(data: dict[str, Any]) -> bytes:
    return b"data: " + _compact(data).encode() + b"\n\n"


class _DeadlineStream(EventStreamResponse):
    """An event stream whose every write must be taken within `write_timeout` seconds."""

    def __init__(self, request: web.Request, write_timeout: float) -> None:
        super().__init__(status=200, headers=SSE_HEADERS)
        self._transport = request.transport
        self._write_timeout = write_timeout

    def _stalled(self) -> ConnectionResetError:
        if self._transport is not None:
            self._transport.abort()
        return ConnectionResetError("the client did not read within stream_write_timeout")

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write(data)
        except TimeoutError:
            raise self._stalled() from None

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write_eof(data)
        except TimeoutError:
            raise self._stalled() from None


async def open_stream(request: web.Request, write_timeout: float) -> web.StreamResponse:
    response = _DeadlineStream(request, write_timeout)
    await response.prepare(request)
    return response


async def send_events(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    """Write every ready event in one write; nothing when there are none."""
    if events:
        await response.write(b"".join(map(encode_event, events)))


async def send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(encode_event(data))


async def send_done(
    response: web.StreamResponse, events: list[dict[str, Any]] | None = None
) -> None:
    """The last events, `[DONE]` and the end of the body, in one write."""
    await response.write_eof(b"".join(map(encode_event, events or ())) + DONE)
