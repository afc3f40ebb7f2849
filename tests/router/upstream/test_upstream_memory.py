"""Issue 21, finding 4: oversized answers must not pile up in the router. A worker that
answers every request with more than max_response_bytes: all buffered answers together
stay under max_buffered_answer_bytes (over it: 503, no breaker), a broken connection's
parser and buffers are freed at once (no reference cycle left for a full GC), and the
process's RSS does not grow with the number of such answers."""

from __future__ import annotations

import asyncio
import gc
import re
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.http.state import FLEET
from router.upstream.connection import UpstreamBroken
from router.upstream.pool import UpstreamPool
from router.upstream.proxy import PROXY
from router.upstream.resolver import GuardedResolver
from tests.router.conftest import StartRouter

MB = 1 << 20
CHUNK = b"x" * (256 * 1024)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def _huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request with a 16 MB chunked JSON body (no length to refuse it by)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            found = re.search(rb"\r\nx-request-id: ([^\r]*)", head, re.IGNORECASE)
            rid = found[1] if found else b"-"
            writer.write(
                b"HTTP/1.1 200 OK\r\nx-request-id: %s\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" % rid
            )
            for _ in range(16 * MB // len(CHUNK)):
                writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def huge_worker() -> AsyncIterator[str]:
    server = await asyncio.start_server(_huge, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def test_broken_connections_free_their_parser_and_buffers_without_a_gc(
    huge_worker: str,
) -> None:
    pool = UpstreamPool(GuardedResolver(), 2.0, 10.0, 4 * MB, max_buffered_total=64 * MB)
    made: list[weakref.ref[Any]] = []
    factory = pool._protocol

    def recorded() -> Any:
        conn = factory()
        made.append(weakref.ref(conn))
        return conn

    pool._protocol = recorded  # type: ignore[method-assign]
    gc.collect()
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        before = _rss()
        for i in range(40):
            answer = await pool.post(huge_worker, "/v1/completions", [], b"{}", f"m{i}")
            with pytest.raises(UpstreamBroken):
                await answer.read_all()
            assert answer.too_big
            answer.close()
            del answer
            await asyncio.sleep(0)  # the transport's close callbacks
        await asyncio.sleep(0.05)
        grown = _rss() - before
        alive = [r for r in made if r() is not None]
    finally:
        gc.enable()
        await pool.close()
    assert len(made) == 40
    assert alive == []  # no connection (or parser) waits for a GC
    assert pool.budget.used == 0
    # 40 answers cut at 4 MB each: 160 MB if the buffers waited for a GC.
    assert grown < 48 * MB, grown


@pytest.mark.parametrize("transport", ["own", "aiohttp"])
async def test_concurrent_oversized_answers_stay_within_the_total_cap(
    huge_worker: str, start_router: StartRouter, transport: str
) -> None:
    """16 at once, each allowed 12 MB but all together 24 MB: the ones that would go over
    get 503 overloaded; nothing is charged to the worker for the router's own limit."""
    client = await start_router(
        [huge_worker], upstream_client=transport, max_response_bytes=12 * MB,
        max_buffered_answer_bytes=24 * MB, max_retries=0,
    )  # fmt: skip
    before = _rss()

    async def one() -> tuple[int, str]:
        r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
        return r.status, (await r.json())["error"]["code"]

    results = await asyncio.gather(*(one() for _ in range(16)))
    pool = client.server.app[PROXY].pool
    assert pool.budget.peak <= 24 * MB + 2 * MB  # the cap, plus at most the chunk over it
    assert pool.budget.used == 0
    assert {code for _, code in results} <= {"overloaded", "upstream_error"}
    assert (503, "overloaded") in results
    [worker] = client.server.app[FLEET].workers.values()
    # Over max_response_bytes with no second worker to confirm: not charged; over the
    # router's own total: never charged.
    assert worker.failures_total == 0
    assert _rss() - before < 200 * MB
