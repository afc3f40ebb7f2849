"""A loopback TCP worker whose every byte a test scripts, for the upstream client's tests.

`RawUpstream` reads each request (head + Content-Length body) off a kept-alive
connection and hands it to `answer`, which writes whatever the case needs and returns
True to hang up. The `raw_upstreams` fixture (tests/router/conftest.py) starts them
and closes them after the test.
"""

from __future__ import annotations

import asyncio


class RawUpstream:
    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def answer(
        self, conn: int, n: int, head: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer request `n` of connection `conn`; True hangs up."""
        raise NotImplementedError

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, n = self.connections, 0
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                if await self.answer(conn, n, head, body, writer):
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def request_id(head: bytes) -> bytes:
    return head[head.lower().index(b"x-request-id: ") + 14 :].split(b"\r\n")[0]
