"""One conformance suite for the router's HTTP server, run over raw sockets on loopback
against every implementation in `SERVERS`: the same client bytes must get the same
answers (status, HTTP version, framing, the OpenAI error shape where the router
answers) and leave the connection in the same state.

Both are the router as `serve()` serves it (router/http/app.py `serving_runner` and
`serving_protocol`): "aiohttp" is aiohttp's server for every request (the hot paths of
router/http/edge.py, the head deadline of shared/serving/http_server.py; config
`fast_hot_paths: false`), "fast" the router's own protocol for the simplest inference
requests in front of it (router/http/fast_server.py, the default). The table is what
aiohttp does, recorded case by case before the own protocol was written; the own
protocol may serve the router only while it passes this table unchanged (the house rule
for protocol code written by hand, as tests/router/upstream/test_transport_conformance.py
holds the upstream client).

A case is the bytes a client writes (tests/router/raw_client.py: sleeps and a close
between them), the answers it must read, in order, and the connection's fate:
`closed` (the server closes it), `reusable` (a good request sent next on it is answered
200: the case's bytes were framed exactly, nothing left over is taken for a request) or
`held` (neither: the server is still reading a body it was promised).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from router.http.app import create_app, serving_protocol, serving_runner, stop_serving
from shared.config import RouterConfig
from shared.serving.http_server import bind
from tests.router.conftest import StartWorkers, url_of
from tests.router.fakes import FakeWorker
from tests.router.raw_client import Answer, Exchange, exchange

SERVERS = ["aiohttp", "fast"]  # config fast_hot_paths off / on
BODY_LIMIT = 4096  # max_body_bytes of the router under test
HEAD_DEADLINE = 0.5  # header_read_timeout of the router under test

OK_BODY = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 2}).encode()
STREAM_BODY = json.dumps({"model": "sim", "prompt": "hi", "stream": True}).encode()
CHAT_BODY = json.dumps({"messages": [{"role": "user", "content": "h\u00e9 \u4f60\u597d"}]}).encode()


def post(path: bytes = b"/v1/completions", body: bytes = OK_BODY, extra: bytes = b"",
         version: bytes = b"1.1") -> bytes:  # fmt: skip
    """A request as the router's clients send it, `extra` header lines added."""
    return (
        b"POST %s HTTP/%s\r\nHost: router\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (path, version, extra, len(body), body)
    )


def chunked_post(chunks: bytes, extra: bytes = b"", te: bytes = b"chunked") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"%sTransfer-Encoding: %s\r\n\r\n%s" % (extra, te, chunks)
    )


def chunks(*parts: bytes, ext: bytes = b"", end: bytes = b"0\r\n\r\n") -> bytes:
    return b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in parts) + end


def headers(n: int) -> bytes:
    return b"".join(b"X-H%d: 1\r\n" % i for i in range(n))


@dataclass(frozen=True)
class Want:
    """One answer: `body` is "ok" (a completion relayed), "health" (GET /health's),
    "stream" (an SSE stream relayed to its end), "openai" (the router's error object, `error` its (type, code)),
    "text" (aiohttp's own plain-text answer: no request id, the router never saw the
    request) or "none" (no body by rule: HEAD, 1xx). `rid`: the x-request-id answered,
    "new" for one the server made, None for none."""

    status: int
    body: str = "ok"
    framing: str = "content-length"
    version: str = "1.1"
    error: tuple[str, str | None] | None = None
    rid: str | None = "new"
    connection: str | None = None  # the Connection header answered, if any


OK = Want(200)
TEXT_400 = Want(400, "text", version="1.0", rid=None)
BAD_JSON = Want(400, "openai", error=("invalid_request_error", "invalid_json"))
TOO_LARGE = Want(413, "openai", error=("invalid_request_error", "body_too_large"))
NOT_ALLOWED = Want(405, "openai", error=("invalid_request_error", None))


@dataclass(frozen=True)
class Case:
    steps: list[Any]
    answers: tuple[Want, ...]
    fate: str  # "closed", "reusable" or "held"
    head_only: bool = False  # answers to HEAD: heads only


SPLIT = len(OK_BODY) // 2
HEAD = post(body=OK_BODY)[: -len(OK_BODY)]

CASES: dict[str, Case] = {
    # -- bodies
    "content-length": Case([post()], (OK,), "reusable"),
    "content-length-in-pieces": Case([HEAD, ("sleep", 0.05), OK_BODY[:SPLIT], ("sleep", 0.05), OK_BODY[SPLIT:]], (OK,), "reusable"),
    "content-length-trailing-space": Case([post().replace(b"Length: 52", b"Length: 52 ")], (OK,), "reusable"),
    "chunked": Case([chunked_post(chunks(OK_BODY[:SPLIT], OK_BODY[SPLIT:]))], (OK,), "reusable"),
    "chunked-in-pieces": Case([chunked_post(b""), ("sleep", 0.05), chunks(OK_BODY[:SPLIT], end=b""), ("sleep", 0.05), chunks(OK_BODY[SPLIT:])], (OK,), "reusable"),
    "chunk-extension": Case([chunked_post(chunks(OK_BODY, ext=b";a=b"))], (OK,), "reusable"),
    "chunked-trailer": Case([chunked_post(chunks(OK_BODY, end=b"0\r\nX-T: 1\r\n\r\n"))], (OK,), "reusable"),
    "no-body": Case([b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n\r\n"], (BAD_JSON,), "reusable"),
    "empty-body": Case([post(body=b"")], (BAD_JSON,), "reusable"),
    "content-length-leading-zeros": Case([post().replace(b"Length: 52", b"Length: 0052")], (OK,), "reusable"),
    "two-hosts": Case([post(extra=b"Host: other\r\n")], (TEXT_400,), "closed"),
    "empty-and-padded-values": Case([post(extra=b"X-A:\r\nX-B: \t a \t b \t\r\n")], (OK,), "reusable"),
    "get-with-a-body": Case([b"GET /health HTTP/1.1\r\nHost: router\r\nContent-Length: 3\r\n\r\nabc"], (Want(200, "health"),), "reusable"),
    # -- connections
    "pipelined": Case([post(extra=b"x-request-id: a\r\n") + post(extra=b"x-request-id: b\r\n")], (Want(200, rid="a"), Want(200, rid="b")), "reusable"),
    "pipelined-mixed": Case([post(extra=b"x-request-id: a\r\n") + post(body=b"{no", extra=b"x-request-id: b\r\n") + post(path=b"/v1/chat/completions", body=CHAT_BODY, extra=b"x-request-id: c\r\n")],
                            (Want(200, rid="a"), Want(400, "openai", error=BAD_JSON.error, rid="b"), Want(200, rid="c")), "reusable"),
    "keep-alive": Case([post(), ("sleep", 0.05), post()], (OK, OK), "reusable"),
    "connection-close": Case([post(extra=b"Connection: close\r\n")], (Want(200, connection="close"),), "closed"),
    "connection-close-then-more": Case([post(extra=b"Connection: close\r\n"), ("sleep", 0.1), post()], (Want(200, connection="close"),), "closed"),
    "http10": Case([post(version=b"1.0")], (Want(200, version="1.0"),), "closed"),
    "http10-keep-alive": Case([post(version=b"1.0", extra=b"Connection: keep-alive\r\n")], (Want(200, version="1.0", connection="keep-alive"),), "reusable"),
    "http10-chunked": Case([chunked_post(chunks(OK_BODY)).replace(b"HTTP/1.1", b"HTTP/1.0")], (Want(200, version="1.0"),), "closed"),
    "stream": Case([post(body=STREAM_BODY)], (Want(200, "stream", "chunked"),), "reusable"),
    "stream-connection-close": Case([post(body=STREAM_BODY, extra=b"Connection: close\r\n")], (Want(200, "stream", "chunked", connection="close"),), "closed"),
    "http10-stream": Case([post(body=STREAM_BODY, version=b"1.0")], (Want(200, "stream", "close", version="1.0"),), "closed"),
    "expect-100-continue": Case([HEAD.replace(b"Host", b"Expect: 100-continue\r\nHost"), ("sleep", 0.1), OK_BODY], (Want(100, "none", "none", rid=None), OK), "reusable"),
    "expect-100-continue-http10": Case([HEAD.replace(b"Host", b"Expect: 100-continue\r\nHost").replace(b"HTTP/1.1", b"HTTP/1.0"), ("sleep", 0.1), OK_BODY], (Want(200, version="1.0"),), "closed"),
    "expect-unknown": Case([post(extra=b"Expect: something\r\n")], (Want(417, "text", rid=None),), "reusable"),
    "upgrade-on-post": Case([post(extra=b"Connection: Upgrade\r\nUpgrade: websocket\r\n")], (OK,), "reusable"),
    # -- smuggling shapes: refused, and the connection closed (nothing after them is a request)
    "cl-and-te": Case([chunked_post(chunks(OK_BODY), extra=b"Content-Length: 5\r\n")], (TEXT_400,), "closed"),
    "te-and-cl": Case([chunked_post(chunks(OK_BODY)).replace(b"chunked\r\n", b"chunked\r\nContent-Length: 5\r\n")], (TEXT_400,), "closed"),
    "two-content-lengths": Case([post(extra=b"Content-Length: 3\r\n")], (TEXT_400,), "closed"),
    "same-content-length-twice": Case([post(extra=b"Content-Length: 52\r\n")], (TEXT_400,), "closed"),
    "content-length-list": Case([post().replace(b"Length: 52", b"Length: 52, 52")], (TEXT_400,), "closed"),
    "content-length-plus": Case([post().replace(b"Length: 52", b"Length: +52")], (TEXT_400,), "closed"),
    "content-length-5000-digits": Case([post().replace(b"Length: 52", b"Length: " + b"9" * 5000)], (TEXT_400,), "closed"),
    "content-length-negative": Case([post(body=b"").replace(b"Length: 0", b"Length: -1")], (TEXT_400,), "closed"),
    "te-chunked-twice": Case([chunked_post(chunks(OK_BODY), extra=b"Transfer-Encoding: chunked\r\n")], (TEXT_400,), "closed"),
    "te-chunked-identity": Case([chunked_post(chunks(OK_BODY), te=b"chunked, identity")], (TEXT_400,), "closed"),
    "te-identity-with-length": Case([post().replace(b"Content-Length", b"Transfer-Encoding: identity\r\nContent-Length")], (TEXT_400,), "closed"),
    # aiohttp takes a coding before `chunked` and does not apply it (the JSON is plain).
    "te-gzip-chunked": Case([chunked_post(chunks(OK_BODY), te=b"gzip, chunked")], (OK,), "reusable"),
    "chunk-size-not-hex": Case([chunked_post(b"zz\r\nabc\r\n0\r\n\r\n")], (TEXT_400,), "closed"),
    "chunk-size-overflow": Case([chunked_post(b"ffffffffffffffffffff\r\nabc\r\n0\r\n\r\n")], (TEXT_400,), "closed"),
    "chunk-size-trailing-space": Case([chunked_post(chunks(OK_BODY).replace(b"\r\n", b" \r\n", 1))], (TEXT_400,), "closed"),
    "chunk-lines-lf-only": Case([chunked_post(b"%x\n%s\n0\n\n" % (len(OK_BODY), OK_BODY))], (TEXT_400,), "closed"),
    "obs-fold": Case([post(extra=b"X-A: a\r\n b\r\n")], (TEXT_400,), "closed"),
    "bare-lf": Case([post().replace(b"\r\n", b"\n")], (TEXT_400,), "closed"),
    "space-before-colon": Case([post(extra=b"X-A : 1\r\n")], (TEXT_400,), "closed"),
    "nul-in-value": Case([post(extra=b"X-A: a\x00b\r\n")], (TEXT_400,), "closed"),
    "del-in-value": Case([post(extra=b"X-A: a\x7fb\r\n")], (TEXT_400,), "closed"),
    "garbage-after-a-request": Case([post(), ("sleep", 0.1), b"GARBAGE\r\n\r\n"], (OK, TEXT_400), "closed"),
    # -- sizes: aiohttp's limits are 8190 bytes a URL, name or value and 128 headers
    "url-8190": Case([post(path=b"/v1/completions?" + b"a" * (8190 - 16))], (OK,), "reusable"),
    "url-8191": Case([post(path=b"/v1/completions?" + b"a" * (8191 - 16))], (TEXT_400,), "closed"),
    "value-8190": Case([post(extra=b"X-A: " + b"v" * 8190 + b"\r\n")], (OK,), "reusable"),
    "value-8191": Case([post(extra=b"X-A: " + b"v" * 8191 + b"\r\n")], (TEXT_400,), "closed"),
    "name-9000": Case([post(extra=b"X" * 9000 + b": 1\r\n")], (TEXT_400,), "closed"),
    "128-headers": Case([post(extra=headers(125))], (OK,), "reusable"),
    "129-headers": Case([post(extra=headers(126))], (TEXT_400,), "closed"),
    "160-kb-of-headers": Case([post(extra=b"".join(b"X-%d: %s\r\n" % (i, b"v" * 8000) for i in range(20)))], (OK,), "reusable"),
    # An oversized body is answered 413 and the rest of it read and dropped: the
    # connection stays usable once the promised body is in.
    "body-over-limit": Case([post(body=b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}')], (TOO_LARGE,), "reusable"),
    "body-over-limit-chunked": Case([chunked_post(chunks(b"a" * 3000, b"a" * 3000))], (TOO_LARGE,), "reusable"),
    # Promised 100 MB: answered 413 at the limit. aiohttp then reads and drops the rest
    # for up to 10 s (its lingering time); bytes that still come after the answer count
    # as the head of a next request, late by the head deadline: closed.
    "body-declared-huge": Case([HEAD.replace(b"Length: 52", b"Length: 100000000") + b"a" * (2 * BODY_LIMIT)], (TOO_LARGE,), "held"),
    "body-declared-huge-still-coming": Case([HEAD.replace(b"Length: 52", b"Length: 100000000") + b"a" * (2 * BODY_LIMIT), ("sleep", 0.2), b"a" * 1000], (TOO_LARGE,), "closed"),
    # -- methods, targets, versions
    "head-on-a-hot-route": Case([b"HEAD /v1/completions HTTP/1.1\r\nHost: router\r\n\r\n"], (Want(405, "none", "none"),), "reusable", head_only=True),
    "get-on-a-hot-route": Case([b"GET /v1/completions HTTP/1.1\r\nHost: router\r\n\r\n"], (NOT_ALLOWED,), "reusable"),
    "options-on-a-hot-route": Case([b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: router\r\n\r\n"], (NOT_ALLOWED,), "reusable"),
    "unknown-method": Case([b"FOO /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 0\r\n\r\n"], (TEXT_400,), "closed"),
    "lowercase-method": Case([post().replace(b"POST", b"post", 1)], (TEXT_400,), "closed"),
    "query-on-a-hot-route": Case([post(path=b"/v1/completions?x=1&y=%20")], (OK,), "reusable"),
    "chat-route": Case([post(path=b"/v1/chat/completions", body=CHAT_BODY)], (OK,), "reusable"),
    "absolute-form": Case([post(path=b"http://router/v1/completions")], (OK,), "reusable"),
    "trailing-slash": Case([post(path=b"/v1/completions/")], (Want(404, "openai", error=("not_found_error", None)),), "reusable"),
    "no-host-http11": Case([post().replace(b"Host: router\r\n", b"")], (TEXT_400,), "closed"),
    "http-1.2": Case([post(version=b"1.2")], (TEXT_400,), "closed"),
    "http-2.0-request-line": Case([post(version=b"2.0")], (Want(200, version="2.0"),), "closed"),
    "http2-preface": Case([b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"], (TEXT_400,), "closed"),
    "http09": Case([b"GET /health\r\n"], (), "closed"),
    "tls-client-hello": Case([b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03"], (TEXT_400,), "closed"),
    # -- bytes beyond ASCII
    "utf8-header-value": Case([post(extra=b"X-A: caf\xc3\xa9\r\n")], (OK,), "reusable"),
    "bad-request-id": Case([post(extra=b"x-request-id: a b\xc3\xa9\r\n")], (OK,), "reusable"),
    "non-ascii-path": Case([post(path=b"/v1/compl\xc3\xa9tions")], (TEXT_400,), "closed"),
    "non-ascii-query": Case([post(path=b"/v1/completions?x=\xc3\xa9")], (TEXT_400,), "closed"),
    "non-utf8-body": Case([post(body=b'{"prompt": "\xff\xfe"}')], (Want(400, "openai", error=BAD_JSON.error),), "reusable"),
    # -- time
    "silent-client": Case([("sleep", 2 * HEAD_DEADLINE)], (), "closed"),
    "slow-headers": Case([HEAD[:40], ("sleep", 2 * HEAD_DEADLINE), HEAD[40:] + OK_BODY], (), "closed"),
}  # fmt: skip


@dataclass(frozen=True)
class Served:
    host: str
    port: int
    worker: FakeWorker | None = None


async def start_served(kind: str, config: RouterConfig) -> tuple[Served, Any]:
    """The router at `config`, listening as `kind` serves it; and how to stop it."""
    config = config.model_copy(update={"fast_hot_paths": kind == "fast"})
    runner = await serving_runner(create_app(config))
    protocol = serving_protocol(runner, config)
    await bind(runner, config.host, 0, header_read_timeout=config.header_read_timeout,
               protocol=protocol)  # fmt: skip
    return Served(config.host, runner.addresses[0][1]), partial(stop_serving, runner, protocol)


@pytest.fixture(params=SERVERS)
async def served(
    request: pytest.FixtureRequest, fake_workers: StartWorkers
) -> AsyncIterator[Served]:
    [(fake, worker)] = await fake_workers("ok", stream_chunks=3, chunk_delay=0.05)
    config = RouterConfig(
        worker_urls=(url_of(worker),), host="127.0.0.1", max_body_bytes=BODY_LIMIT,
        header_read_timeout=HEAD_DEADLINE,
    )  # fmt: skip
    server, stop = await start_served(request.param, config)
    yield Served(server.host, server.port, fake)
    await stop()


def check(got: Answer, want: Want) -> None:
    assert (got.status, got.version, got.framing) == (want.status, want.version, want.framing)
    assert got.headers.get("connection") == want.connection
    rid = got.headers.get("x-request-id")
    if want.rid == "new":
        assert rid is not None and len(rid) == 32, rid
    else:
        assert rid == want.rid
    content_type = got.headers.get("content-type", "")
    if want.body == "ok":
        assert content_type.startswith("application/json")
        assert got.json()["choices"][0]["text"] == "abc" and "x-radix-worker" in got.headers
    elif want.body == "health":
        assert got.json()["status"] == "ok"
    elif want.body == "stream":
        assert content_type == "text/event-stream"
        assert got.body.startswith(b"data: ") and got.body.endswith(b"data: [DONE]\n\n")
    elif want.body == "openai":
        error = got.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["type"], error["code"]) == want.error
    elif want.body == "text":
        assert content_type.startswith("text/plain") and got.body
    else:
        assert got.body == b""


async def play(server: Served, case: Case) -> Exchange:
    steps = list(case.steps)
    wanted = len(case.answers)
    if case.fate == "reusable":
        steps += [("sleep", 0.05), post(extra=b"x-request-id: next\r\n")]
        wanted += 1
    quiet = 3.0 if case.fate == "closed" else 0.5
    return await exchange(
        server.host, server.port, steps, quiet=quiet, head_only=case.head_only,
        want=wanted if case.fate == "reusable" else None,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
async def test_a_case_gets_the_recorded_answers(served: Served, name: str) -> None:
    case = CASES[name]
    got = await play(served, case)
    answers = got.answers
    if case.fate == "reusable":
        # The next request on the connection is answered as itself.
        *answers, last = answers
        if case.head_only:
            assert last.status == 200 and last.headers["x-request-id"] == "next"
        else:
            check(last, Want(200, rid="next"))
    assert len(answers) == len(case.answers), (answers, got.trailing[:200])
    for answer, want in zip(answers, case.answers, strict=True):
        check(answer, want)
    assert got.closed == (case.fate == "closed")
    assert got.trailing == b""


# -- a client that goes away: no effect on anyone else ------------------------------------


async def _others_unharmed(server: Served, leave: list[Any]) -> None:
    """While a client plays `leave` (and goes away), a stream on another connection and
    pipelined requests on a third are answered whole; and a new connection after."""
    others = asyncio.gather(
        exchange(server.host, server.port, [post(body=STREAM_BODY)], want=1),
        exchange(server.host, server.port, [post() + post()], want=2),
    )
    gone = await exchange(server.host, server.port, leave)
    stream, pair = await others
    assert gone.answers == [] or gone.answers[0].status == 200
    check(stream.answers[0], Want(200, "stream", "chunked"))
    assert [a.status for a in pair.answers] == [200, 200]
    after = await exchange(server.host, server.port, [post()], want=1)
    check(after.answers[0], OK)


async def test_a_client_that_closes_mid_body(served: Served) -> None:
    await _others_unharmed(served, [HEAD, OK_BODY[:SPLIT], ("sleep", 0.05), "close"])


async def test_a_client_that_closes_mid_chunked_body(served: Served) -> None:
    await _others_unharmed(served, [chunked_post(chunks(OK_BODY[:SPLIT], end=b"")), "close"])


async def test_a_client_that_closes_mid_stream(served: Served) -> None:
    await _others_unharmed(served, [post(body=STREAM_BODY), ("sleep", 0.07), "close"])


async def test_the_worker_sees_the_same_headers(served: Served) -> None:
    """Header values as aiohttp decodes them (UTF-8, other bytes surrogate-escaped and so
    not forwarded), without the whitespace around them; the session header routes."""
    extra = (
        b"User-Agent: caf\xc3\xa9 \xe2\x98\x95\r\nAccept: \t a \t\r\n"
        b"traceparent: \xff\xfe\r\nx-session-id: s\xc3\xa9s\r\nx-request-id: r-1\r\n"
    )
    got = await exchange(served.host, served.port, [post(extra=extra)], want=1)
    check(got.answers[0], Want(200, rid="r-1"))
    assert served.worker is not None
    seen = served.worker.headers_seen[-1]
    assert (seen["User-Agent"], seen["Accept"], seen["x-session-id"]) == ("café ☕", "a", "sés")
    assert "traceparent" not in seen and seen["X-Request-ID"] == "r-1"
