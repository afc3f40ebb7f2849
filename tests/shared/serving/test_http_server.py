"""The request-head deadline (shared/serving/http_server.py) on a real aiohttp app on loopback,
driven by raw sockets: what it closes, and what it must leave alone."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from shared.serving.http_server import KEEPALIVE_S, BindError, bind

DEADLINE_S = 0.3
REQUEST = b"GET /hi HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/hi", lambda _: web.Response(text="hi"))
    runner = web.AppRunner(app, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    await bind(runner, "127.0.0.1", 0, header_read_timeout=DEADLINE_S)
    yield runner.addresses[0][1]
    await runner.cleanup()


async def closed_by_server(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    """Whether the server ends the connection (EOF) within `within` seconds."""
    try:
        while await asyncio.wait_for(reader.read(4096), within):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


async def answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head + await asyncio.wait_for(reader.readexactly(2), 5)  # "hi"


async def test_silent_and_half_sent_connections_are_closed(port: int) -> None:
    silent = await asyncio.open_connection("127.0.0.1", port)
    half = await asyncio.open_connection("127.0.0.1", port)
    half[1].write(b"GET /hi HTTP/1.1\r\nHost: x\r\nX-Long: aaaa")
    assert await closed_by_server(silent[0])
    assert await closed_by_server(half[0])
    for _, writer in (silent, half):
        writer.close()


async def test_a_late_second_head_on_a_kept_alive_connection_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    assert (await answer(reader)).startswith(b"HTTP/1.1 200")
    writer.write(b"GET /hi HTTP/1.1\r\nHo")
    assert await closed_by_server(reader)
    writer.close()


async def test_idle_kept_alive_connections_and_trickled_heads_are_served(port: int) -> None:
    """An idle pooled connection (a router's to its workers) outlives the head deadline;
    a head sent in pieces that completes in time is answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    await answer(reader)
    await asyncio.sleep(3 * DEADLINE_S)  # idle: no byte of a next request
    for piece in (b"GET /hi HT", b"TP/1.1\r\nHo", b"st: x\r\n", b"\r\n"):
        writer.write(piece)
        await asyncio.sleep(DEADLINE_S / 10)
    assert (await answer(reader)).startswith(b"HTTP/1.1 200")
    writer.close()


async def test_a_taken_port_is_one_bind_error() -> None:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"127.0.0.1:{port}: address already in use"):
            await bind(runner, "127.0.0.1", port, header_read_timeout=1)
    await runner.cleanup()
