"""Server-sent events the way OpenAI streams: one `data:` line per chunk, then `[DONE]`.

Each chunk is written (and so flushed to the socket) as soon as the engine yields it;
aiohttp's server sockets have TCP_NODELAY set, so no chunk waits for the next.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Tells nginx-style proxies in front of the worker not to buffer the stream.
    "X-Accel-Buffering": "no",
}


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
