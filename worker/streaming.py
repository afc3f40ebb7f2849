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

import json
from typing import Any

from aiohttp import web

from shared.http import EVENT_STREAM, DeadlineStream

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


async def open_stream(request: web.Request, write_timeout: float) -> web.StreamResponse:
    response = DeadlineStream(request, write_timeout, status=200, headers=SSE_HEADERS)
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
