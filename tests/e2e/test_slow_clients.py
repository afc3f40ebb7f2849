"""A client that opens a stream and never reads it must not hold the worker's engine
slot (and its KV) for as long as it stays connected: after `stream_write_timeout` the
router aborts the upstream request, and a worker does the same on its own streams.
The real router and sim worker apps on loopback; the client is a raw socket with a
small receive buffer that never calls recv. Was: held for as long as it stayed open."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestServer

from router.http.state import FLEET
from shared.config import RouterConfig
from tests.fuzz.conftest import start_router, start_worker, worker_config
from tests.waiting import wait_until
from worker.http.state import ENGINE

STREAM = {"prompt": "x", "max_tokens": 200_000, "ignore_eos": True, "stream": True}


@pytest.fixture
async def worker() -> AsyncIterator[TestServer]:
    # The worker's own deadline is long here, so the router case proves the router's.
    server = await start_worker(worker_config(
        cache_tokens=300_000, max_model_len=300_000, stream_write_timeout=60.0,
    ))  # fmt: skip
    yield server
    await server.close()


async def open_stream_and_never_read(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps(STREAM).encode()
    sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    return sock


async def slot_freed(worker: TestServer, within: float) -> bool:
    """True once the engine runs nothing; first proves the stream did take a slot."""
    engine = worker.app[ENGINE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while engine.stats().running == 0:
        assert loop.time() < deadline, "the stream never started"
        await asyncio.sleep(0.02)
    while loop.time() < deadline:
        if engine.stats().running == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_router_aborts_the_upstream_of_a_client_that_does_not_read(
    worker: TestServer,
) -> None:
    url = str(worker.make_url("")).rstrip("/")
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(url,), stream_write_timeout=1.0,
    ))  # fmt: skip
    sock = await open_stream_and_never_read(router.port)
    try:
        # Buffers fill within a second or two, then one write waits out the deadline.
        assert await slot_freed(worker, within=20.0)
        assert sock.fileno() != -1  # the client is still connected: the deadline did it
        # The router's books follow within moments: its handler unwinds after the
        # aborted upstream connection reached the worker (same loop here).
        workers = router.app[FLEET].workers.values()
        await wait_until(lambda: [w.in_flight for w in workers] == [0])
    finally:
        sock.close()
        await router.close()


async def test_worker_aborts_its_own_stream_to_a_client_that_does_not_read() -> None:
    server = await start_worker(worker_config(
        cache_tokens=300_000, max_model_len=300_000, stream_write_timeout=1.0,
    ))  # fmt: skip
    sock = await open_stream_and_never_read(server.port)
    try:
        assert await slot_freed(server, within=20.0)
    finally:
        sock.close()
        await server.close()
