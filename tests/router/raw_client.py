"""A loopback HTTP client whose every byte a test scripts, for the server's tests.

The mirror of `raw_upstream.py`: `RawClient` writes exactly the bytes a case gives
(framing mistakes, smuggling shapes, pipelined requests, a half-sent head) and reads
back, with httptools' response parser, every answer the server writes on that
connection until it closes it or stays quiet for `quiet` seconds. An answer is what a
server is held to: its status, its headers (lower-cased names), its body, how the body
was framed (`content-length`, `chunked`, `close`: delimited by the close, `none`: no
body by rule, as after HEAD or a 1xx/204/304), and the connection's fate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import httptools


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    framing: str = "none"
    version: str = "1.1"

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Exchange:
    answers: list[Answer] = field(default_factory=list)
    closed: bool = False  # the server closed (or reset) the connection
    trailing: bytes = b""  # bytes after the last whole answer (a cut one)


class _Heads:
    """Answers to HEAD: heads only, whatever their headers say (httptools cannot be told
    that an answer has no body, so these are split by hand)."""

    def __init__(self) -> None:
        self.done: list[Answer] = []
        self.current: Answer | None = None
        self.buffer = b""

    def feed_data(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            status_line, *lines = head.decode("latin-1").split("\r\n")
            version, status = status_line.split(" ")[:2]
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.lower()] = value.strip()
            self.done.append(Answer(int(status), headers, version=version.removeprefix("HTTP/")))


class _Collector:
    """httptools callbacks: whole answers in order."""

    def __init__(self) -> None:
        self.done: list[Answer] = []
        self.current: Answer | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.feed_data = self.parser.feed_data

    def on_message_begin(self) -> None:
        self.current = Answer(0, {})

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self.current.headers.get(key)
        self.current.headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> bool:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()
        self.current.version = self.parser.get_http_version()
        headers = self.current.headers
        if "transfer-encoding" in headers:
            self.current.framing = "chunked"
        elif "content-length" in headers:
            self.current.framing = "content-length"
        elif self.current.status >= 200 and self.current.status not in (204, 304):
            self.current.framing = "close"
        return False

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        if self.current.status < 200 or self.current.status in (204, 304):
            self.current.framing = "none"
        self.done.append(self.current)
        self.current = None


# A step of a case: bytes to send, ("sleep", s), "shut" (half-close: no more bytes from
# the client) or "close" (the client goes away; nothing more is read).
Step = Any


async def exchange(
    host: str, port: int, steps: list[Step], *, quiet: float = 0.5, want: int | None = None,
    head_only: bool = False,
) -> Exchange:  # fmt: skip
    """Play `steps` on one connection, then read answers until the server closes it,
    `want` answers came, or nothing arrived for `quiet` seconds."""
    reader, writer = await asyncio.open_connection(host, port)
    collector = _Heads() if head_only else _Collector()
    parse = collector.feed_data
    out = Exchange(answers=collector.done)
    raw = bytearray()
    feed_error = False

    def feed(data: bytes) -> None:
        nonlocal feed_error
        raw.extend(data)
        if feed_error:
            return
        try:
            parse(data)
        except (httptools.HttpParserError, ValueError):
            feed_error = True

    async def drain_ready() -> None:
        # What arrived while the client was still sending (a 100 Continue, an early 400).
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.01)
            except TimeoutError:
                return
            if not data:
                out.closed = True
                return
            feed(data)

    try:
        for step in steps:
            if isinstance(step, bytes):
                with contextlib.suppress(ConnectionError):
                    writer.write(step)
                    await writer.drain()
            elif step == "shut":
                with contextlib.suppress(ConnectionError, OSError):
                    writer.write_eof()
            elif step == "close":
                return out
            else:
                await asyncio.sleep(step[1])
            if not out.closed:
                with contextlib.suppress(ConnectionError):
                    await drain_ready()
        while not out.closed and (want is None or len(collector.done) < want):
            try:
                data = await asyncio.wait_for(reader.read(65536), quiet)
            except TimeoutError:
                break
            except ConnectionError:
                out.closed = True
                break
            if not data:
                out.closed = True
                break
            feed(data)
        current = collector.current
        if out.closed and current is not None and current.framing == "close":
            collector.done.append(current)  # a close-delimited body ends with the connection
        elif current is not None or feed_error:
            out.trailing = bytes(raw)
        return out
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
