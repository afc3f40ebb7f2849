"""What a worker's answer may be, whichever client reads it (router/upstream/transport.py).

Limits both transports apply: aiohttp's own field limits (8,190 bytes a header name or
value, 128 headers) for the own client too, a head of at most 64 KB, header values of
visible ASCII, chunked as the only transfer coding (no `TE` is sent, so a worker may
apply no other), and the budget of bytes all buffered answers may hold at once.
"""

from __future__ import annotations

import re

MAX_HEAD_BYTES = 65536  # status line and headers of one answer; beyond: a broken worker
MAX_HEADERS = 128
MAX_FIELD_BYTES = 8190  # one header name, value, or the status line (aiohttp's limits)
# What a header value may hold: visible ASCII, space and tab (no other controls, no DEL,
# no bytes above 0x7f: they became mojibake on the way to clients).
BAD_VALUE = re.compile(rb"[^\t\x20-\x7e]")
BAD_TEXT_VALUE = re.compile(r"[^\t\x20-\x7e]")  # the same, on decoded text


def close_delimited(status: int, content_length: int | None, chunked: bool) -> bool:
    """Whether an answer's body ends with the connection: no length, not chunked, and a
    status that has a body at all (204 and 304 never do, whatever the headers say: RFC
    9112 6.3; the parsers end them at the head)."""
    return content_length is None and not chunked and status not in (204, 304)


class UpstreamBroken(Exception):
    """The connection failed, or the worker's bytes are not one well-framed answer."""


class ForeignAnswer(UpstreamBroken):
    """The connection was broken by another answer's bytes (an echo of another request's
    id, no echo on a reused connection, a second answer begun) before this request's own
    answer was read: the request itself may be innocent, and nothing of it reached its
    client, so the proxy sends it once more on a fresh connection (issue 31)."""


class BufferBudget:
    """Bytes of buffered (non-streamed) answers held across every connection of a pool:
    16 concurrent 64 MB answers took the router from 70 MB to 1.2 GB (issue 21)."""

    __slots__ = ("limit", "peak", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most held at once (a test's and an operator's check)


def only_chunked(values: list[str]) -> bool:
    """Transfer-Encoding lines that say `chunked` once and nothing else."""
    return [v.strip().lower() for line in values for v in line.split(",")] == ["chunked"]
