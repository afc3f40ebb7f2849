"""The router's own protocol (router/http/fast_server.py) keeps its bounds: what a client
sends while a fast answer is being written waits, but at most `MAX_PENDING` bytes of it
(then reading pauses), and a stream in flight is not disturbed by it; a stream to a
client that never reads holds at most the high-water mark and one chunk, then is
aborted; at shutdown `serve()` closes its kept-alive connections, which aiohttp's
cleanup does not see. Its answers (router/http/fast_answer.py) are framed as aiohttp
frames them: heads byte for byte, header values read alike, an answer with no body left
to aiohttp. Its answers and hand-overs are held to aiohttp's by
tests/router/http/test_server_conformance.py and tests/router/http/test_hot_paths.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from typing import Any

import pytest
from multidict import CIMultiDict

from router.http.app import create_app, serve, serving_protocol, serving_runner
from router.http.fast_server import MAX_PENDING, FastProtocol
from router.http.state import FLEET
from shared.config import RouterConfig
from shared.serving.http_server import bind
from tests.router.conftest import StartRouter, StartWorkers, url_of
from tests.router.raw_upstream import RawUpstream, request_id
from tests.waiting import wait_until

STREAM = json.dumps({"model": "sim", "prompt": "hi", "stream": True}).encode()
READ = 256 * 1024  # the most one read hands a protocol (asyncio's and uvloop's)
HIGH_WATER = 65536  # a transport's default high-water mark (asyncio's and uvloop's)


async def _serve_recording(config: RouterConfig) -> tuple[Any, list[FastProtocol]]:
    """The router served as `serve()` serves it, on a free port, keeping each connection's
    own protocol (the list) for the test to read."""
    runner = await serving_runner(create_app(config))
    factory = serving_protocol(runner, config)
    assert factory is not None
    made: list[FastProtocol] = []

    def recording() -> asyncio.Protocol:
        protocol = factory()
        assert isinstance(protocol, FastProtocol)
        made.append(protocol)
        return protocol

    await bind(runner, "127.0.0.1", 0, header_read_timeout=10, protocol=recording)
    return runner, made


async def _post(port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A new connection, one simple completion request on it (the fast protocol's to
    answer), and its answer's head (a 200)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return reader, writer, head


async def test_bytes_read_during_an_answer_are_bounded(fake_workers: StartWorkers) -> None:
    [(_, worker)] = await fake_workers("ok", stream_chunks=20, chunk_delay=0.05)  # ~1 s
    config = RouterConfig(worker_urls=(url_of(worker),), host="127.0.0.1", fast_hot_paths=True)
    runner, made = await _serve_recording(config)
    try:
        reader, writer, head = await _post(runner.addresses[0][1], STREAM)
        assert b"text/event-stream" in head  # the stream has begun
        for _ in range(64):  # 4 MB while the answer is written, not drained
            writer.write(b"x" * 65536)
        await asyncio.sleep(0.3)
        [protocol] = made
        assert MAX_PENDING < len(protocol._pending) <= MAX_PENDING + READ
        # The stream goes on to its end (then the bytes are aiohttp's: a 400, closed).
        await asyncio.wait_for(reader.readuntil(b"data: [DONE]"), 10)
        writer.close()
    finally:
        await runner.cleanup()


async def test_serve_closes_idle_fast_connections_at_shutdown(fake_workers: StartWorkers) -> None:
    [(_, worker)] = await fake_workers("ok")
    config = RouterConfig(worker_urls=(url_of(worker),), host="127.0.0.1", port=0,
                          fast_hot_paths=True, drain_timeout=1)  # fmt: skip
    listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(config, ready=listening.set_result))
    port = await asyncio.wait_for(listening, 10)
    body = json.dumps({"model": "sim", "prompt": "hi", "max_tokens": 2}).encode()
    reader, writer, head = await _post(port, body)
    assert b"Connection: close" not in head
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)  # answered by the fast protocol, kept alive, idle
    os.kill(os.getpid(), signal.SIGTERM)  # serve()'s handler: stop
    await asyncio.wait_for(served, 10)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
    writer.close()


async def test_a_connection_answering_at_shutdown_closes_once_its_answer_is_written(
    fake_workers: StartWorkers,
) -> None:
    [(_, worker)] = await fake_workers("ok", stream_chunks=5, chunk_delay=0.05)
    config = RouterConfig(worker_urls=(url_of(worker),), host="127.0.0.1", fast_hot_paths=True)
    runner = await serving_runner(create_app(config))
    fast = serving_protocol(runner, config)
    assert fast is not None
    await bind(runner, "127.0.0.1", 0, header_read_timeout=10, protocol=fast)
    try:
        reader, writer, head = await _post(runner.addresses[0][1], STREAM)
        assert b"text/event-stream" in head  # the stream has begun
        fast.close()
        rest = await asyncio.wait_for(reader.read(), 10)  # the whole stream, then closed
        assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")
        writer.close()
    finally:
        await runner.cleanup()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One buffered answer off a kept connection: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


async def test_a_repeated_head_is_read_once_and_any_other_head_again(
    fake_workers: StartWorkers,
) -> None:
    """A connection keeps the last head it took and what it found in it: the same head
    again is not parsed again, yet each request is its own (its body, its id); a new
    head is read anew, and the same head whose body is not exactly its Content-Length
    (here a second request after it) is still aiohttp's."""
    [(fake, worker)] = await fake_workers("ok")
    config = RouterConfig(worker_urls=(url_of(worker),), host="127.0.0.1", fast_hot_paths=True)
    runner, made = await _serve_recording(config)

    def request(rid: bytes, body: bytes) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nx-request-id: %s\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (rid, len(body), body))  # fmt: skip

    one = json.dumps({"model": "sim", "prompt": "one", "max_tokens": 2}).encode()
    two = json.dumps({"model": "sim", "prompt": "two", "max_tokens": 2}).encode()
    assert len(one) == len(two)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(request(b"id-a", one))
        head, _ = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"x-request-id: id-a\r\n" in head
        [protocol] = made
        kept = protocol._last.found
        assert kept is not None
        writer.write(request(b"id-a", two))  # the same head, another body
        head, _ = await _read_answer(reader)
        assert protocol._last.found is kept and b"x-request-id: id-a\r\n" in head
        assert [b["prompt"] for b in fake.bodies_seen] == ["one", "two"]  # each its body
        writer.write(request(b"id-b", one))  # another head: read anew
        head, _ = await _read_answer(reader)
        assert b"x-request-id: id-b\r\n" in head and protocol._last.found is not kept
        assert protocol.transport is not None  # all three fast answers
        writer.write(request(b"id-b", one) + request(b"id-c", two))  # one read, two requests
        for rid in (b"id-b", b"id-c"):
            head, _ = await _read_answer(reader)
            assert b"x-request-id: %s\r\n" % rid in head
        assert protocol.transport is None  # handed to aiohttp
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_stream_to_a_client_that_never_reads_holds_bounded_memory(
    fake_workers: StartWorkers,
) -> None:
    """The own protocol writes a stream's chunks itself (router/http/fast_answer.py): once
    the transport is paused (its buffer past the high-water mark) a write waits, at most
    `stream_write_timeout`, then the connection is aborted and the worker's stream closed.
    Without the wait every chunk of the answer would pile up in the router's buffer."""
    [(_, worker)] = await fake_workers("ok", stream_chunks=40_000)  # ~2.6 MB of events
    config = RouterConfig(worker_urls=(url_of(worker),), host="127.0.0.1",
                          fast_hot_paths=True, stream_write_timeout=0.5)  # fmt: skip
    runner, made = await _serve_recording(config)
    sock = socket.socket()  # the client: a small window, never read
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", runner.addresses[0][1]))
        [protocol] = made
        await wait_until(lambda: protocol.transport is not None)
        # The router's side too (else the kernel's send buffer, tuned up to megabytes on
        # loopback, takes the whole answer and the router never waits).
        router_side = protocol.transport.get_extra_info("socket")
        router_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(STREAM), STREAM))  # fmt: skip
        await wait_until(lambda: protocol._busy)  # the answer has begun
        most, bound = 0, HIGH_WATER + READ  # the high-water mark and one relayed chunk
        while protocol.transport is not None and most <= bound:  # until the deadline
            most = max(most, protocol.transport.get_write_buffer_size())
            await asyncio.sleep(0.01)
        assert 0 < most <= bound, most
        assert protocol.transport is None  # aborted, though the client is still there
        # The handler unwound: the worker's stream closed, its seat given back.
        workers = runner.app[FLEET].workers.values()
        await wait_until(lambda: [w.in_flight for w in workers] == [0])
    finally:
        sock.close()
        await runner.cleanup()


async def test_heads_are_serialized_as_aiohttp_serializes_them() -> None:
    """An own answer (router/http/fast_answer.py) leaves as the bytes aiohttp's serializer
    writes for its status line and final headers, then its body, in one write; a control
    character in a name or value is refused (ValueError) and nothing is written."""
    from types import SimpleNamespace

    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_writer import _serialize_headers

    from router.http.fast_answer import FAST, FastReply
    from router.http.fast_server import route_request_class

    class Recording(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:  # type: ignore[override]
            self.writes.append(data)

        def is_closing(self) -> bool:
            return False

    def on(sink: Recording) -> BaseProtocol:
        protocol = BaseProtocol(asyncio.get_running_loop())
        protocol.connection_made(sink)
        return protocol

    async def awaited(request: Any, response: Any) -> None:  # a receiver, not a HeadHook
        pass

    # Both ways a buffered answer leaves: its hooks as plain calls (`reply_now`), or
    # awaited (`_whole`: an app with a receiver that is not a `HeadHook`).
    for hooks in ((), (awaited,)):
        match = SimpleNamespace(current_app=None)
        requests = route_request_class("/v1/completions", None, match, hooks)  # type: ignore[arg-type]
        for fields in (
            [],
            [("Content-Type", "application/json"), ("x-request-id", "r" * 32)],
            [("X-A", "1"), ("x-a", "2"), ("X-Ünï", "välue ✓"), ("Empty", "")],
        ):
            sink = Recording()
            request = requests(CIMultiDict(), b"{}", on(sink))  # type: ignore[arg-type]
            reply = FastReply(200, CIMultiDict(fields), b"body")
            assert await FAST.finish(request, reply)
            assert sink.writes == [_serialize_headers("HTTP/1.1 200 OK", reply.headers) + b"body"]
            assert reply.headers["Content-Length"] == "4" and "Date" in reply.headers  # framed
        for bad in (
            ("X-A", "1\r\nSet-Cookie: s=1"),
            ("X-A", "a\nb"),
            ("X\rA", "1"),
            ("X-A", "\x00"),
        ):
            sink = Recording()
            request = requests(CIMultiDict(), b"{}", on(sink))  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                await FAST.finish(request, FastReply(200, CIMultiDict([bad]), b"body"))
            assert sink.writes == []


def test_header_values_are_read_as_aiohttp_reads_them() -> None:
    """`_simple` splits the lines the pattern checked: a value keeps its inner spaces,
    tabs and colons and loses the whitespace at its ends, as aiohttp's parser gives it."""
    from router.http.fast_head import simple as _simple

    body = b'{"prompt": "x"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-A:\t v:1  2 \t\r\nX-E:\r\n"
            b"X-U: \xc3\xa4\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
    found = _simple(head + body, 1024)
    assert found is not None
    path, headers, rest = found
    assert (path, rest) == ("/v1/completions", body)
    assert list(headers.items()) == [
        ("Host", "r"), ("X-A", "v:1  2"), ("X-E", ""), ("X-U", "ä"),
        ("Content-Length", str(len(body))),
    ]  # fmt: skip
    assert _simple(b"POST /v1/completions HTTP/1.1\r\n\r\n", 1024) is None  # no Host


def test_a_last_head_answers_as_reading_the_head_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LastHead.take` (a head like the last one but for its Content-Length value is not
    read again) gives `read_head`'s answer, headers item by item, on random changes to
    a taken head: to that value (digits, OWS, signs, controls, CR, LF, too large) and to
    any other byte (the request line, names, other values)."""
    import random

    from router.http import fast_head
    from router.http.fast_head import LastHead, read_head

    reads = []  # the heads `LastHead` read anew
    monkeypatch.setattr(fast_head, "read_head", lambda h, m: reads.append(h) or read_head(h, m))
    bases = [
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 12\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length:7\r\nHost: r\r\nX-A: 1\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nCONTENT-LENGTH: \t 003 \r\nX: y\r\n",
    ]
    pieces = [b"0", b"7", b"12", b"1024", b"1025", b"99999999999999999999", b" ", b"\t",
              b"", b"-1", b"+1", b"a", b"\r", b"\n", b"\r\n", b"\x00", b"\xd9\xa3", b"1 2"]  # fmt: skip
    rng = random.Random(36)
    reused = 0
    for base in bases:
        at = base.lower().index(b"content-length:") + len(b"content-length:")
        end = base.index(b"\r\n", at)
        for _ in range(3000):
            if rng.random() < 0.8:  # another length value
                value = b"".join(rng.choices(pieces, k=rng.randrange(1, 4)))
                head = base[:at] + value + base[end:]
            else:  # any other byte changed
                i = rng.randrange(len(base))
                head = base[:i] + bytes([rng.randrange(256)]) + base[i + 1 :]
            last = LastHead()
            assert last.take(base, 1024) is not None
            found, expected = last.take(head, 1024), read_head(head, 1024)
            assert (found is None) == (expected is None), head
            if found is not None and expected is not None:
                assert found[0] == expected[0] and found[2] == expected[2], head
                assert list(found[1].items()) == list(expected[1].items()), head
                assert last.head == head and last.found is found
                reused += reads[-1] != head
    assert reused > 500  # the kept way taken often (~830 of 9000)


def test_the_head_pattern_accepts_what_the_strict_grammar_accepts() -> None:
    """`_HEAD`'s one character class per field accepts exactly the heads of the grammar
    it stands for (a name, a colon, OWS, a value whose inner whitespace runs are each
    followed by a visible character, OWS, CRLF), on random heads over an alphabet of
    every kind of character that matters: controls, SP, HTAB, CR, LF, DEL, colons,
    bytes beyond ASCII and surrogate escapes."""
    import random
    import re

    from router.http.fast_head import _HEAD, _NAME

    visible = r"[^\x00-\x20\x7f]"
    value = rf"(?:{visible}|[ \t]++(?={visible}))*+"
    grammar = re.compile(
        rf"POST (/v1/completions|/v1/chat/completions) HTTP/1\.1\r\n"
        rf"(?:{_NAME}:[ \t]*+{value}[ \t]*+\r\n)*+"
    )
    alphabet = ["a", "Z", "-", ":", " ", "\t", "\r", "\n", "\r\n", "\x00", "\x01", "\x1f",
                "\x7f", "\x80", "ä", "\udc80", "(", '"', "/", "\x0b"]  # fmt: skip
    rng = random.Random(34)
    accepted = 0
    for _ in range(20000):
        fields = []
        for _ in range(rng.randrange(4)):
            name = "".join(
                rng.choices(["X", "a", "-", "9", "!", " ", ":", "é"], k=rng.randrange(4))
            )
            fields.append(name + ":" + "".join(rng.choices(alphabet, k=rng.randrange(8))) + "\r\n")
        head = "POST /v1/completions HTTP/1.1\r\n" + "".join(fields)
        ours, spec = _HEAD.fullmatch(head), grammar.fullmatch(head)
        assert (ours is None) == (spec is None), repr(head)
        accepted += ours is not None
    assert 1000 < accepted < 19000  # both ways taken often


async def test_an_answer_with_no_body_is_written_by_aiohttp_either_way(
    start_router: StartRouter, raw_upstreams: Any
) -> None:
    """A worker's 204 (no body may follow): the own protocol leaves it to aiohttp's writer
    (router/http/fast_answer.py), so it reads as through aiohttp's server, header by
    header, and the kept connection answers the next request."""

    class NoContent(RawUpstream):
        async def answer(self, conn: int, n: int, head: bytes, body: bytes,
                         writer: asyncio.StreamWriter) -> bool:  # fmt: skip
            # A length of 0: the upstream client reads a 204 without one to the close.
            writer.write(b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 0\r\nx-request-id: %s\r\n\r\n" % request_id(head))  # fmt: skip
            return False

    worker = await raw_upstreams(NoContent())
    heads = []
    for fast in (True, False):
        client = await start_router([worker.url], fast_hot_paths=fast)
        for _ in range(2):  # the second on the same kept connection
            async with client.post("/v1/completions", json={"prompt": "hi"}) as r:
                assert (r.status, await r.read()) == (204, b"")
                assert r.headers["x-request-id"]  # each its own: left out below
                names = [k for k, _ in r.raw_headers]
                heads.append([(k, v if k != b"x-request-id" else b"") for k, v in r.raw_headers
                              if k != b"Date"])  # fmt: skip
                assert names.count(b"x-request-id") == 1
    assert heads[:2] == heads[2:]  # the fast way = aiohttp's, request by request
    assert b"Content-Length" not in dict(heads[0])
