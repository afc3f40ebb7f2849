"""A connection of the router's own protocol (router/http/fast_server.py) has one task,
made by its first fast request: it answers the connection's requests one after the
other and ends with the connection, whichever way that ends (the client closes it while
idle, it is handed over to aiohttp, the client leaves mid-answer: that answer is
cancelled and counted 499, as aiohttp's handler_cancellation; the shutdown closes it).
No task is left behind."""

from __future__ import annotations

import asyncio
import json
import re

from router.http.fast_server import FastProtocol
from shared.config import RouterConfig
from tests.router.conftest import StartWorkers, url_of
from tests.router.http.test_fast_server import STREAM, _read_answer, _serve_recording
from tests.waiting import wait_until

BODY = json.dumps({"model": "sim", "prompt": "hi", "max_tokens": 2}).encode()


def _completion(body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body,
    )  # fmt: skip


def _connection_tasks() -> list[asyncio.Task]:
    """The running tasks that are a connection's (`FastProtocol._serve`)."""
    return [
        t for t in asyncio.all_tasks()
        if not t.done() and t.get_coro().__qualname__ == FastProtocol._serve.__qualname__
    ]  # fmt: skip


async def test_a_connections_task_answers_its_requests_and_ends_with_it(
    fake_workers: StartWorkers,
) -> None:
    [(worker, server)] = await fake_workers("ok", stream_chunks=10, chunk_delay=0.05)
    config = RouterConfig(worker_urls=(url_of(server),), host="127.0.0.1", fast_hot_paths=True)
    runner, made = await _serve_recording(config)
    port = runner.addresses[0][1]
    try:
        # Four kept-alive connections, three answers each, every one its own id.
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        ids = set()
        for _ in range(3):
            for reader, writer in kept:
                writer.write(_completion(BODY))
                head, body = await _read_answer(reader)
                assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
                ids.add(re.search(rb"(?i)x-request-id: (\S+)", head)[1])  # type: ignore[index]
        assert len(ids) == 12
        assert len(_connection_tasks()) == 4  # one a connection, idle between requests

        # Handed over while idle (a route of aiohttp's): its task ends, aiohttp answers.
        reader, writer = kept[0]
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 ")
        await wait_until(lambda: len(_connection_tasks()) == 3)
        assert made[0].transport is None  # aiohttp's now

        # The client closes an idle connection: its task ends.
        kept[1][1].close()
        await wait_until(lambda: len(_connection_tasks()) == 2)

        # The client leaves mid-stream: the answer is cancelled, counted 499, the task ends.
        reader, writer = kept[2]
        writer.write(_completion(STREAM))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"text/event-stream" in head
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)
        writer.transport.abort()
        await wait_until(lambda: len(_connection_tasks()) == 1)
        await wait_until(lambda: worker.cancelled == 1)
        assert worker.completed == 12

        # A request sent while an answer is being written waits for it, then is answered
        # by the same task.
        reader, writer = kept[3]
        writer.write(_completion(STREAM))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"text/event-stream" in head
        writer.write(_completion(BODY))
        await asyncio.wait_for(reader.readuntil(b"data: [DONE]"), 10)
        await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)  # the stream's end
        head, body = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
        assert len(_connection_tasks()) == 1 and worker.completed == 14

        # Then a route of aiohttp's: the last task ends.
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")  # handed over
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])  # type: ignore[index]
        metrics = (await reader.readexactly(length)).decode()
        assert re.search(
            r'_requests_total\{endpoint="[^"]*completions",status="499"\} 1\.0', metrics
        )
        assert _connection_tasks() == []

        # Forty more, answered once and kept open: the shutdown's close ends every task.
        more = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
        for _, writer in more:
            writer.write(_completion(BODY))
        for reader, _ in more:
            head, _ = await _read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200")
        assert len(_connection_tasks()) == 40
        made[0]._server.close()  # as router/http/app.py's shutdown, before runner.cleanup()
        await wait_until(lambda: _connection_tasks() == [])
        for reader, _ in more:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
        for _, writer in kept + more:
            writer.close()
    finally:
        await runner.cleanup()
