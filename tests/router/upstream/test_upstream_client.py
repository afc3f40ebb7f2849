"""The router's own upstream client (router/upstream/pool.py, router/upstream/connection.py)
against a raw TCP worker on loopback whose every byte the test scripts: keep-alive reuse,
a keep-alive connection the worker closed under the router, garbage, broken chunked
framing, a stall mid-body, bytes nobody asked for. Through a real router app, so the
failure classes, retries and breaker counts are the proxy's own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from router.http.state import FLEET
from router.upstream.proxy import PROXY
from tests.router.conftest import StartRouter
from tests.router.raw_upstream import RawUpstream
from tests.waiting import wait_until

BODY = {"prompt": "hello there", "max_tokens": 3}
ANSWER = json.dumps({"id": "x", "object": "text_completion", "choices": []}).encode()
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(ANSWER),
    ANSWER,
)
# Script: (connection number, request number on it) -> bytes to send, or a verb.
Script = Callable[[int, int], Any]


def _echo(answer: bytes, head: bytes) -> bytes:
    """`answer` with the request's x-request-id echoed after its status line, as the
    project's worker does (a connection is reused only after an echo)."""
    rid = head.lower().split(b"x-request-id: ")[1].split(b"\r\n")[0]
    status, sep, rest = answer.partition(b"\r\n")
    return status + sep + b"x-request-id: " + rid + b"\r\n" + rest if sep else answer


class RawWorker(RawUpstream):
    """Does what `script` says for each request: bytes to send, "close" (hang up without
    a byte), "stall" (send nothing, keep open), or (bytes, "close"): send, then hang up.
    With `echo` the request id is echoed."""

    def __init__(self, script: Script, echo: bool = True) -> None:
        super().__init__()
        self.script = script
        self.echo = echo
        self.requests: list[bytes] = []

    async def answer(
        self, conn: int, n: int, head: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        self.requests.append(head + body)
        action = self.script(conn, n)
        if action == "close":
            return True
        if action == "stall":
            await asyncio.sleep(30)
        if isinstance(action, tuple):
            writer.write(_echo(action[0], head) if self.echo else action[0])
            return True
        writer.write(_echo(action, head) if self.echo else action)
        await writer.drain()
        return False


@pytest.fixture
def raw_workers(raw_upstreams: Any) -> Callable[..., Awaitable[RawWorker]]:
    async def start(script: Script, echo: bool = True) -> RawWorker:
        return await raw_upstreams(RawWorker(script, echo))

    return start


def failures(client: Any) -> dict[str, int]:
    return {w.url: w.failures_total for w in client.server.app[FLEET].workers.values()}


async def test_keep_alive_connections_are_reused(
    raw_workers: Any, start_router: StartRouter
) -> None:
    worker = await raw_workers(lambda c, n: OK)
    client = await start_router([worker.url], policy="round_robin")
    for _ in range(5):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert worker.connections == 1 and len(worker.requests) == 5
    head = worker.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/completions http/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:" in head and b"accept-encoding: identity" in head
    assert client.server.app[PROXY].pool.connects == 1


async def test_a_keep_alive_connection_closed_under_the_router_is_retried_uncharged(
    raw_workers: Any, start_router: StartRouter
) -> None:
    """The worker hangs up the kept connection as the next request arrives (its idle
    timeout racing the router's send): resent once on a fresh connection, no failure."""
    worker = await raw_workers(lambda c, n: "close" if (c, n) == (0, 1) else OK)
    client = await start_router([worker.url], policy="round_robin", max_retries=0)
    for _ in range(3):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    pool = client.server.app[PROXY].pool
    assert pool.stale_retries == 1 and worker.connections == 2
    assert failures(client) == {worker.url: 0}
    scraped = await (await client.get("/metrics")).text()
    assert "radix_router_upstream_stale_retries_total 1.0" in scraped
    assert "radix_router_upstream_connections_opened_total 2.0" in scraped


class EchoesOnce(RawWorker):
    """Echoes the request id on a connection's first answer only."""

    async def answer(
        self, conn: int, n: int, head: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        self.echo = n == 0
        return await super().answer(conn, n, head, body, writer)


async def test_the_first_reuse_of_a_connection_must_echo_the_request_id(
    raw_upstreams: Any, start_router: StartRouter
) -> None:
    """An answer on a reused connection without the echo is not provably this request's:
    the connection breaks on the very first reuse. It may be another answer's late copy,
    so the request goes once more on a fresh connection (issue 31), whose first answer
    is provably its own: answered, and counted as a resend, not as the worker's failure."""
    worker = await raw_upstreams(EchoesOnce(lambda c, n: OK))
    client = await start_router([worker.url], policy="round_robin", max_retries=0)
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    r = await client.post("/v1/completions", json=BODY)  # the kept connection, no echo
    assert r.status == 200
    assert worker.connections == 2 and failures(client) == {worker.url: 0}
    metrics = await (await client.get("/metrics")).text()
    assert "radix_router_upstream_foreign_answer_retries_total 1.0" in metrics


async def test_a_worker_that_hangs_up_on_fresh_connections_is_a_failure(
    raw_workers: Any, start_router: StartRouter
) -> None:
    worker = await raw_workers(lambda c, n: "close")
    client = await start_router([worker.url], max_retries=0)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_error"
    assert failures(client) == {worker.url: 1} and worker.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HELLO WORLD\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 3\r\n"
        b"Content-Length: 9\r\n\r\n{}}",  # two lengths
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n",  # a huge head
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
        b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # a chunk size that is not hex
        OK + b"HTTP/1.1 200 OK\r\n\r\n",  # a second answer nobody asked for
        b"HTTP/1.1 200 OK\r\nX-Name: caf\xc3\xa9\r\n" + OK[17:],  # a non-ASCII value
        b"HTTP/1.1 204 No Content\r\n\r\n" + ANSWER,  # a 204 with a body
    ],
    ids=[
        "garbage",
        "two-lengths",
        "huge-head",
        "bad-chunk",
        "second-answer",
        "non-ascii",
        "204-body",
    ],
)
async def test_a_garbage_speaking_worker_harms_no_other_request(
    raw_workers: Any, start_router: StartRouter, answer: bytes
) -> None:
    bad = await raw_workers(lambda c, n: answer)
    good = await raw_workers(lambda c, n: OK)
    client = await start_router([bad.url, good.url], policy="round_robin", max_retries=1)
    for _ in range(4):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 200, await r.text()
    pool = client.server.app[PROXY].pool
    # The bad worker's connections never went back to the pool: one per request it got.
    assert bad.connections == len(bad.requests)
    assert good.connections == 1 and failures(client)[good.url] == 0
    # A sound answer with a second one after it is no sound answer: never relayed. Those
    # bytes may be another request's late answer, so that request was sent once more on
    # a fresh connection (issue 31) before the worker's failure was counted.
    resent = 2 if answer.count(b"HTTP/1.1 ") > 1 else 1
    assert failures(client)[bad.url] * resent == len(bad.requests) >= 1
    assert pool.stale_retries == 0


async def test_a_stream_with_broken_chunked_framing_ends_with_an_error_event(
    raw_workers: Any, start_router: StartRouter
) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    event = b'data: {"choices": []}\n\n'
    worker = await raw_workers(lambda c, n: head + b"%x\r\n%s\r\nqq\r\n" % (len(event), event))
    client = await start_router([worker.url], max_retries=0)
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    text = await r.text()
    assert r.status == 200 and text.startswith(event.decode())
    assert "upstream_error" in text and "not HTTP/1.1" in text
    assert failures(client) == {worker.url: 1}


async def test_a_worker_that_stalls_mid_body_times_out_and_is_not_reused(
    raw_workers: Any, start_router: StartRouter
) -> None:
    partial = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    # The first connection stalls after one byte of the body.
    worker = await raw_workers(lambda c, n: partial if c == 0 else OK)
    client = await start_router([worker.url], max_retries=0, request_timeout=0.3)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 504, await r.text()
    # One timeout, no other worker to compare with: not known to be the worker's fault.
    assert failures(client) == {worker.url: 0}
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert worker.connections == 2  # the stalled connection was dropped, not pooled


class LateOnce(RawWorker):
    """Answers at once, except request 1 of connection 0: `late` seconds later."""

    def __init__(self, late: float) -> None:
        super().__init__(lambda c, n: OK)
        self.late = late

    async def answer(
        self, conn: int, n: int, head: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        if (conn, n) == (0, 1):
            await asyncio.sleep(self.late)
        return await super().answer(conn, n, head, body, writer)


async def test_a_kept_connection_times_each_exchange_from_its_own_send(
    raw_upstreams: Any, raw_workers: Any, start_router: StartRouter
) -> None:
    """A connection's one timer (router/upstream/connection.py), armed for the first
    exchange's deadline, fires in the middle of the second's wait: it must neither cut
    the second short (its answer comes after the first's deadline, within its own) nor
    leave it waiting forever (a stall on the kept connection still times out)."""
    worker = await raw_upstreams(LateOnce(late=1.5))
    client = await start_router([worker.url], max_retries=0, request_timeout=2.0)
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    await asyncio.sleep(1.0)  # the first deadline passes during the next wait
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 200, await r.text()
    assert worker.connections == 1  # both on the kept connection

    stalls = await raw_workers(lambda c, n: OK if n == 0 else "stall")
    client = await start_router([stalls.url], max_retries=0, request_timeout=0.3)
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 504, await r.text()
    assert stalls.connections == 1


async def test_a_stall_that_another_worker_does_not_repeat_is_the_workers_failure(
    raw_workers: Any, start_router: StartRouter
) -> None:
    partial = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    stalls = await raw_workers(lambda c, n: partial)
    good = await raw_workers(lambda c, n: OK)
    client = await start_router(
        [stalls.url, good.url], policy="round_robin", max_retries=1, request_timeout=0.3
    )
    for _ in range(2):  # round robin: one of the two goes to the stalling worker first
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert failures(client) == {stalls.url: len(stalls.requests), good.url: 0}
    assert len(stalls.requests) >= 1


async def test_a_body_ending_with_the_connection_is_read_whole(
    raw_workers: Any, start_router: StartRouter
) -> None:
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + ANSWER
    worker = await raw_workers(lambda c, n: (answer, "close"))
    client = await start_router([worker.url], max_retries=0)
    for _ in range(2):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 200 and await r.read() == ANSWER
    assert worker.connections == 2 and failures(client) == {worker.url: 0}


async def test_a_compressed_answer_is_a_bad_answer(
    raw_workers: Any, start_router: StartRouter
) -> None:
    answer = OK.replace(b"Content-Length", b"Content-Encoding: gzip\r\nContent-Length")
    worker = await raw_workers(lambda c, n: answer)
    client = await start_router([worker.url], max_retries=0)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 502 and "content encoding" in (await r.json())["error"]["message"]


async def test_a_connection_the_worker_closed_while_idle_is_not_handed_out(
    raw_workers: Any, start_router: StartRouter
) -> None:
    """Keep-alive in the headers, then the worker hangs up (an idle timeout of 0): each
    request finds its kept connection gone and opens another, charged to no one."""
    worker = await raw_workers(lambda c, n: (OK, "close"))
    client = await start_router([worker.url], max_retries=0)
    for _ in range(3):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert worker.connections == 3 and failures(client) == {worker.url: 0}


async def test_idle_connections_are_closed_after_keepalive_and_at_shutdown(
    raw_workers: Any,
) -> None:
    from router.upstream.pool import UpstreamPool
    from router.upstream.resolver import GuardedResolver

    worker = await raw_workers(lambda c, n: OK)
    pool = UpstreamPool(GuardedResolver(), 1.0, 5.0, 1 << 20, keepalive_s=0.2)
    for i in range(2):
        conn = await pool.post(worker.url, "/v1/completions", [], b"{}", f"a.{i}")
        assert await conn.read_all() == ANSWER
        pool.release(worker.url, conn)
    assert pool.connects == 1 and conn.error is None
    await wait_until(lambda: conn.error is not None)  # past keepalive_s: the sweeper closed it
    assert not pool._origins
    conn = await pool.post(worker.url, "/v1/completions", [], b"{}", "a.2")
    await conn.read_all()
    pool.release(worker.url, conn)
    await pool.close()
    assert pool.connects == 2 and conn.error is not None
