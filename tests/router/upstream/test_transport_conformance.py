"""One conformance suite for the router's upstream transport (router/upstream/transport.py), run
against the project's own HTTP/1.1 client and against aiohttp's ClientSession through the
same interface: the same scripted worker bytes must give the same outcome through both, and through the own
client with its simple-answer path off (`own-httptools`: httptools reads every answer).

The worker is a raw TCP server on loopback whose every byte the case scripts: framing
(CL+TE, chunk-size overflow, two lengths), statuses (1xx skipped, 101, 304, 999), header
limits (70 KB and 9 KB names, 9 KB values), CR/LF/NUL/DEL/controls and non-ASCII in
values, transfer codings other than chunked, odd lengths and status lines, trailers,
truncation (short length, chunked cut, a reset close-delimited body, a stream cut short),
a slow trickle, a stall, pipelined extras, a 204 with a body, request-id echoes, and
bytes that arrive while a connection sits in the pool."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.upstream.clients import make_transport
from router.upstream.connection import UpstreamBroken, WorkerConnection
from router.upstream.resolver import GuardedResolver
from router.upstream.transport import Transport
from tests.router.raw_upstream import RawUpstream, request_id

OK_BODY = b'{"ok": true}'
ST = b"HTTP/1.1 200 OK\r\nx-request-id: {RID}\r\n"
JSON = b"Content-Type: application/json\r\n"
SSE = b"Content-Type: text/event-stream\r\n"
ANSWER = ST + JSON + b"Content-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY)
READ_TIMEOUT = 0.6

# A step: bytes (with {RID} for the request id), ("sleep", s), "close", "reset".
Steps = list[Any]


class ScriptedWorker(RawUpstream):
    def __init__(self, answers: list[Steps]) -> None:
        super().__init__()
        self.answers = answers  # the steps for request n (the last repeats)
        self.requests = 0

    async def answer(
        self, conn: int, n: int, head: bytes, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        rid = request_id(head)
        steps = self.answers[min(self.requests, len(self.answers) - 1)]
        self.requests += 1
        for step in steps:
            if isinstance(step, bytes):
                writer.write(step.replace(b"{RID}", rid))
                await writer.drain()
            elif step == "close":
                return True
            elif step == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return True
            else:
                await asyncio.sleep(step[1])
        return False


@pytest.fixture(params=["own", "own-httptools", "aiohttp"])
async def transport(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Transport]:
    kind, _, only = request.param.partition("-")
    if only:  # the own client with httptools reading every answer (no `simple_answer`)
        monkeypatch.setattr(WorkerConnection, "simple_heads", False)
    t = make_transport(kind, GuardedResolver(), 2.0, READ_TIMEOUT, 4096, 1 << 20)
    yield t
    await t.close()


@pytest.fixture
def worker(raw_upstreams: Any) -> Any:
    async def start(*answers: Steps) -> ScriptedWorker:
        return await raw_upstreams(ScriptedWorker(list(answers)))

    return start


async def exchange(t: Transport, url: str, rid: str) -> tuple[Any, ...]:
    """What the router would make of one request: ("ok", status, body), ("broken",),
    ("timeout",)."""
    try:
        answer = await t.post(
            url, "/v1/completions", [("Content-Type", "application/json")], b"{}", rid
        )
        try:
            if answer.content_type == "text/event-stream":
                parts = []
                while chunk := await answer.readany():
                    parts.append(chunk)
                body = b"".join(parts)
            else:
                body = await answer.read_all()
        except BaseException:
            answer.close()
            raise
        t.release(url, answer)
        return ("ok", answer.status, body)
    except UpstreamBroken:
        return ("broken",)
    except TimeoutError:
        return ("timeout",)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


TE = b"Transfer-Encoding: chunked\r\n\r\n"
EVENT = b'data: {"choices": []}\n\n'
CASES: dict[str, tuple[Steps, tuple[Any, ...]]] = {
    "content-length": ([ANSWER], ("ok", 200, OK_BODY)),
    "chunked": ([ST + JSON + TE + chunked(b'{"ok"', b": true}") + b"0\r\n\r\n"], ("ok", 200, OK_BODY)),
    "close-delimited": ([ST + JSON + b"\r\n" + OK_BODY, "close"], ("ok", 200, OK_BODY)),
    "close-delimited-reset": ([ST + JSON + b"\r\n" + OK_BODY[:4], ("sleep", 0.05), "reset"], ("broken",)),
    "no-echo-fresh": ([ANSWER.replace(b"x-request-id: {RID}\r\n", b"")], ("ok", 200, OK_BODY)),
    "echo-mismatch": ([ANSWER.replace(b"{RID}", b"someone-else")], ("broken",)),
    "cl-and-te": ([ST + JSON + b"Content-Length: 5\r\n" + TE + chunked(b"{}") + b"0\r\n\r\n"], ("broken",)),
    "chunk-size-overflow": ([ST + JSON + TE + b"ffffffffffffffffffff\r\n{}\r\n0\r\n\r\n"], ("broken",)),
    "chunk-size-not-hex": ([ST + JSON + TE + b"zz\r\n{}\r\n0\r\n\r\n"], ("broken",)),
    "two-lengths": ([ST + JSON + b"Content-Length: 2\r\nContent-Length: 9\r\n\r\n{}"], ("broken",)),
    "not-http": ([b"HELLO WORLD\r\n\r\n"], ("broken",)),
    "status-999": ([b"HTTP/1.1 999 Odd\r\nx-request-id: {RID}\r\nContent-Length: 0\r\n\r\n"], None),
    "status-304": ([b"HTTP/1.1 304 Not Modified\r\nx-request-id: {RID}\r\n\r\n"], ("ok", 304, b"")),
    "100-then-200": ([b"HTTP/1.1 100 Continue\r\n\r\n" + ANSWER], ("ok", 200, OK_BODY)),
    "103-then-200": ([b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", ("sleep", 0.02), ANSWER], ("ok", 200, OK_BODY)),
    "101-switch": ([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"], ("broken",)),
    "huge-header-name": ([ST + b"X" * 70000 + b": 1\r\n" + ANSWER[len(ST):]], ("broken",)),
    "9k-header-name": ([ST + b"X" * 9000 + b": 1\r\n" + ANSWER[len(ST):]], ("broken",)),
    "9k-header-value": ([ST + b"X-Big: " + b"v" * 9000 + b"\r\n" + ANSWER[len(ST):]], ("broken",)),
    "129-headers": ([ST + b"".join(b"X-%d: 1\r\n" % i for i in range(129)) + ANSWER[len(ST):]], ("broken",)),
    "cr-in-value": ([ST + b"X-A: a\rb\r\n" + ANSWER[len(ST):]], ("broken",)),
    "lf-in-value": ([ST + b"X-A: a\nb\r\n" + ANSWER[len(ST):]], None),
    "nul-in-value": ([ST + b"X-A: a\x00b\r\n" + ANSWER[len(ST):]], ("broken",)),
    "non-ascii-value": ([ST + b"X-A: caf\xc3\xa9\r\n" + ANSWER[len(ST):]], ("broken",)),
    "trailers": ([ST + JSON + TE + chunked(OK_BODY) + b"0\r\nX-Trailer: 1\r\n\r\n"], ("ok", 200, OK_BODY)),
    "short-content-length": ([ST + JSON + b"Content-Length: 100\r\n\r\n{", "close"], ("broken",)),
    "chunked-cut": ([ST + JSON + TE + chunked(b'{"ok"'), "close"], ("broken",)),
    "chunked-cut-by-reset": ([ST + JSON + TE + chunked(b'{"ok"'), ("sleep", 0.05), "reset"], ("broken",)),
    "pipelined-extra": ([ANSWER + ANSWER], ("broken",)),
    "204-with-body": ([b"HTTP/1.1 204 No Content\r\nx-request-id: {RID}\r\n\r\n" + OK_BODY], ("broken",)),
    "too-big": ([ST + JSON + b"Content-Length: 5000\r\n\r\n" + b"x" * 5000], ("broken",)),
    "too-big-chunked": ([ST + JSON + TE + chunked(b"x" * 3000, b"x" * 3000) + b"0\r\n\r\n"], ("broken",)),
    "stall-before-head": ([("sleep", 5)], ("timeout",)),
    "stall-mid-body": ([ST + JSON + b"Content-Length: 100\r\n\r\n{", ("sleep", 5)], ("timeout",)),
    # One byte every 0.2 s: each wait is under read_timeout, the whole is not.
    "slow-trickle": ([ST + JSON + b"Content-Length: 12\r\n\r\n", *[x for b in OK_BODY for x in (bytes([b]), ("sleep", 0.2))]], ("timeout",)),
    "chunk-extension-1mb": ([ST + JSON + TE + b"c;ext=" + b"e" * (1 << 20) + b"\r\n" + OK_BODY + b"\r\n0\r\n\r\n"], ("ok", 200, OK_BODY)),
    "space-before-colon": ([ST + b"X-A : 1\r\n" + ANSWER[len(ST):]], ("broken",)),
    "no-reason-phrase": ([b"HTTP/1.1 200\r\nx-request-id: {RID}\r\n" + ANSWER[len(ST):]], ("ok", 200, OK_BODY)),
    "http10-keep-alive": ([b"HTTP/1.0 200 OK\r\nx-request-id: {RID}\r\nConnection: keep-alive\r\n" + ANSWER[len(ST):]], ("ok", 200, OK_BODY)),
    "length-plus-sign": ([ST + JSON + b"Content-Length: +12\r\n\r\n" + OK_BODY], ("broken",)),
    "length-negative": ([ST + JSON + b"Content-Length: -1\r\n\r\n" + OK_BODY], ("broken",)),
    "same-length-twice": ([ST + JSON + b"Content-Length: 12\r\nContent-Length: 12\r\n\r\n" + OK_BODY], ("broken",)),
    "length-list": ([ST + JSON + b"Content-Length: 12, 12\r\n\r\n" + OK_BODY], ("broken",)),
    # No TE is sent: chunked, once, is the only transfer coding a worker may apply.
    "te-gzip-chunked": ([ST + JSON + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked(OK_BODY) + b"0\r\n\r\n"], ("broken",)),
    "te-chunked-identity": ([ST + JSON + b"Transfer-Encoding: chunked, identity\r\n\r\n" + chunked(OK_BODY) + b"0\r\n\r\n", "close"], ("broken",)),
    "te-identity": ([ST + JSON + b"Transfer-Encoding: identity\r\n\r\n" + OK_BODY, "close"], ("broken",)),
    "te-chunked-twice": ([ST + JSON + TE.replace(b"\r\n\r\n", b"\r\n") + TE + chunked(OK_BODY) + b"0\r\n\r\n"], ("broken",)),
    "http2-status-line": ([b"HTTP/2 200 OK\r\nx-request-id: {RID}\r\n" + ANSWER[len(ST):]], ("broken",)),
    "http09-no-head": ([OK_BODY, "close"], ("broken",)),
    "lowercase-http": ([b"http/1.1 200 OK\r\nx-request-id: {RID}\r\n" + ANSWER[len(ST):]], ("broken",)),
    "chunk-lines-lf-only": ([ST + JSON + TE + b"c\n" + OK_BODY + b"\n0\n\n"], ("broken",)),
    "empty-header-name": ([ST + b": x\r\n" + ANSWER[len(ST):]], ("broken",)),
    "tab-in-value": ([ST + b"X-A: a\tb\r\n" + ANSWER[len(ST):]], ("ok", 200, OK_BODY)),
    "del-in-value": ([ST + b"X-A: a\x7fb\r\n" + ANSWER[len(ST):]], ("broken",)),
    "control-in-value": ([ST + b"X-A: a\x01b\r\n" + ANSWER[len(ST):]], ("broken",)),
    "sse-stream": ([ST + SSE + TE + chunked(EVENT, EVENT) + b"0\r\n\r\n"], ("ok", 200, EVENT + EVENT)),
    "sse-stream-cut": ([ST + SSE + TE + chunked(EVENT), ("sleep", 0.02), "close"], ("broken",)),
    # A stream lives as long as it keeps sending: each wait is bounded, not the whole.
    "sse-slow-but-alive": ([ST + SSE + TE, *[x for _ in range(4) for x in (chunked(EVENT), ("sleep", 0.25))], b"0\r\n\r\n"], ("ok", 200, EVENT * 4)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
async def test_one_answer(transport: Transport, worker: Any, case: str) -> None:
    steps, expected = CASES[case]
    w = await worker(steps)
    got = await exchange(transport, w.url, "rid-1")
    if expected is None:  # the suite records what both do; both must agree (below)
        expected = _AGREED[case]
    assert got == expected


# Cases where HTTP leaves a choice: both transports must make the same one.
_AGREED: dict[str, tuple[Any, ...]] = {
    "status-999": (
        "ok",
        999,
        b"",
    ),  # framed well; the proxy refuses it (router/upstream/answers.py)
    "lf-in-value": ("broken",),
}


# Where HTTP lets a recipient be lenient and aiohttp is, the own client refuses: an
# answer framed in an obsolete or ambiguous way is no answer to relay.
STRICTER: dict[str, Steps] = {
    "obs-fold": [ST + b"X-A: a\r\n b\r\n" + ANSWER[len(ST):]],
    "chunk-size-trailing-space": [ST + JSON + TE + b"c \r\n" + OK_BODY + b"\r\n0\r\n\r\n"],
    "head-lines-lf-only": [ANSWER.replace(b"\r\n", b"\n")],
}  # fmt: skip


@pytest.mark.parametrize("case", list(STRICTER))
async def test_the_own_client_is_at_least_as_strict(worker: Any, case: str) -> None:
    w = await worker(STRICTER[case])
    own = make_transport("own", GuardedResolver(), 2.0, READ_TIMEOUT, 4096, 1 << 20)
    lenient = make_transport("aiohttp", GuardedResolver(), 2.0, READ_TIMEOUT, 4096, 1 << 20)
    try:
        assert await exchange(own, w.url, "rid-1") == ("broken",)
        assert await exchange(lenient, w.url, "rid-1") in {("broken",), ("ok", 200, OK_BODY)}
    finally:
        await own.close()
        await lenient.close()


async def test_bytes_that_arrive_while_pooled_are_never_an_answer(
    transport: Transport, worker: Any
) -> None:
    """A second, unrequested answer arrives while the connection sits in the pool: the
    next request gets its own answer (on another connection), never that one."""
    stolen = ANSWER.replace(OK_BODY, b'{"ok": 666}')
    w = await worker([ANSWER, ("sleep", 0.05), stolen], [ANSWER])
    assert await exchange(transport, w.url, "rid-1") == ("ok", 200, OK_BODY)
    await asyncio.sleep(0.2)
    assert await exchange(transport, w.url, "rid-2") == ("ok", 200, OK_BODY)
    assert w.connections == 2


async def test_a_connection_is_reused_only_after_an_echo(transport: Transport, worker: Any) -> None:
    w = await worker([ANSWER])
    for i in range(3):
        assert await exchange(transport, w.url, f"rid-{i}") == ("ok", 200, OK_BODY)
    assert w.connections == 1 and transport.connects == 1
    quiet = await worker([ANSWER.replace(b"x-request-id: {RID}\r\n", b"")])
    for i in range(3):
        assert await exchange(transport, quiet.url, f"rid-{i}") == ("ok", 200, OK_BODY)
    assert quiet.connections == 3  # silence proves nothing: a fresh connection each


async def test_one_request_id_twice_never_shares_a_connection_in_a_row(
    transport: Transport, worker: Any
) -> None:
    w = await worker([ANSWER])
    for _ in range(2):
        assert await exchange(transport, w.url, "same") == ("ok", 200, OK_BODY)
    assert w.connections == 2


async def test_a_late_answer_on_a_reused_connection_is_refused(
    transport: Transport, worker: Any
) -> None:
    """The late copy lands while the next request waits on the connection: refused
    (`broken`, the proxy retries elsewhere), never delivered."""
    stolen = ANSWER.replace(OK_BODY, b'{"ok": 666}')
    # Request 0: answer, then 50 ms later a copy carrying request 0's id.
    w = await worker([ANSWER, ("sleep", 0.05), stolen], [("sleep", 0.2), ANSWER])
    assert await exchange(transport, w.url, "rid-1") == ("ok", 200, OK_BODY)
    assert await exchange(transport, w.url, "rid-2") == ("broken",)


# --- Through a router: what a client sees (issue 21, finding 5) -------------------------

ROUTED: dict[str, tuple[Steps, int, str]] = {
    # (worker steps, client status, what the client's body holds)
    "trickle": (CASES["slow-trickle"][0], 504, "timed out"),
    "close-delimited-cut": ([ST + JSON + b"\r\n" + OK_BODY[:5], "close"], 502, "upstream_error"),
    "short-content-length": (CASES["short-content-length"][0], 502, "upstream_error"),
    "103-then-200": (CASES["103-then-200"][0], 200, '"ok": true'),
    "100-then-200": (CASES["100-then-200"][0], 200, '"ok": true'),
    "204-with-body": (CASES["204-with-body"][0], 502, "upstream_error"),
    # 204 and 304 have no body whatever their headers say (RFC 9112 6.3): not a
    # close-delimited JSON body, and the worker keeps the connection open.
    "204-json-no-length": (
        [b"HTTP/1.1 204 No Content\r\nx-request-id: {RID}\r\n" + JSON + b"\r\n"],
        204,
        "",
    ),
}


@pytest.mark.parametrize("kind", ["own", "aiohttp"])
@pytest.mark.parametrize("case", list(ROUTED))
async def test_through_the_router(worker: Any, start_router: Any, kind: str, case: str) -> None:
    steps, status, holds = ROUTED[case]
    w = await worker(steps)
    # Only the timeout case needs the short deadline; the others keep a roomy one, so a
    # busy CI machine cannot turn a truncation (502) into a timeout (504).
    deadline = READ_TIMEOUT if status == 504 else 10.0
    client = await start_router(
        [w.url], upstream_client=kind, max_retries=0, request_timeout=deadline
    )
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status == status and holds in await r.text()


@pytest.mark.parametrize("kind", ["own", "aiohttp"])
async def test_informational_answers_are_no_strike(
    worker: Any, start_router: Any, kind: str
) -> None:
    from router.http.state import FLEET

    w = await worker(CASES["103-then-200"][0])
    client = await start_router([w.url], upstream_client=kind, breaker_failures=1)
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "hi"})).status == 200
    assert [x.failures_total for x in client.server.app[FLEET].workers.values()] == [0]


@pytest.mark.parametrize("kind", ["own", "aiohttp"])
@pytest.mark.parametrize(
    "steps",
    [
        # ends with the connection, mid-event: a clean close is no end of an event
        [ST + SSE + b"\r\n" + EVENT + b'data: {"choi', "close"],
        # chunked, cut before the last chunk
        [ST + SSE + TE + chunked(EVENT) + chunked(b'data: {"choi'), ("sleep", 0.02), "close"],
    ],
    ids=["close-delimited", "chunked"],
)
async def test_a_stream_cut_short_ends_with_an_error_event(
    worker: Any, start_router: Any, kind: str, steps: Steps
) -> None:
    w = await worker(steps)
    client = await start_router([w.url], upstream_client=kind, max_retries=0)
    r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    text = await r.text()
    # The whole event, then the error event; the partial one is dropped, not glued to it.
    events = text.split("\n\n")
    assert r.status == 200 and events[0] + "\n\n" == EVENT.decode() and events[2:] == [""]
    assert events[1].startswith('data: {"error"') and "upstream_error" in events[1]
