"""The simple-answer path (router/upstream/simple_answer.py, taken by
`AnswerReader._take_simple`) against httptools: the same worker bytes, in the same reads,
must leave a connection in the same state either way (status, headers, body,
completeness, keep-alive, echo, the error text, whether it was another answer's bytes,
the budget), then again after bytes that arrive later, and on the next exchange of a
connection kept.

The answers: every scripted answer of the transport conformance suite and of the desync
probe, hand-made edge cases of the pattern, and seeded random mutations of a plain
answer. Bytes go to the protocol's `data_received` as its transport would hand them
(over a real socket pair): a socket cannot promise where one read ends, and the read
boundaries are what decides which path runs. The conformance suite and the desync probe
themselves also run over real sockets with the simple path off
(`test_transport_conformance.py`, `test_upstream_desync.py`: transport `own-httptools`).

A repeated head (`SimpleReader`: the connection's last head with another id and length)
must read as the pattern reads it: random heads, each again with other ids (some the
pattern does not admit), lengths, and one byte changed; and many exchanges on one kept
connection through both readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from router.upstream import simple_answer as simple_module
from router.upstream.connection import BufferBudget, WorkerConnection
from router.upstream.limits import MAX_FIELD_BYTES
from router.upstream.simple_answer import SimpleReader, simple_answer
from tests.router.upstream.test_transport_conformance import ANSWER, CASES, STRICTER, chunked
from tests.router.upstream.test_upstream_desync import _answer

RID = b"rid-7"
NEXT_RID = b"rid-8"
MAX_BUFFERED = 4096


def _state(conn: WorkerConnection) -> tuple[Any, ...]:
    headers = None if conn.headers is None else list(conn.headers.items())
    return (
        conn.status, headers, conn.content_type, conn.content_length, conn.complete,
        conn.keep_alive, conn.echoed, conn.error, conn.spoiled, conn.foreign, conn.too_big,
        conn.over_budget, b"".join(conn._chunks), conn.budget.used, conn.reusable(),
        conn.close_delimited, conn.is_eof(),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _connection(budget: int = 1 << 20) -> AsyncIterator[WorkerConnection]:
    """A worker connection over a real socket pair (nothing answers on the far end: each
    test hands the answer's bytes to `data_received` itself), closed at the end."""
    ours, theirs = socket.socketpair()
    try:
        _, conn = await asyncio.get_running_loop().connect_accepted_socket(
            lambda: WorkerConnection(5.0, MAX_BUFFERED, lambda c: None, BufferBudget(budget)),
            ours,
        )
        yield conn
        conn.close()
    finally:
        theirs.close()


async def _run(simple: bool, reads: list[bytes], later: Sequence[bytes], budget: int) -> list[Any]:
    """The connection's state after each read of the answer, after each later read, and
    after a plain answer to a next request where the connection may carry one."""
    async with _connection(budget) as conn:
        conn.simple_heads = simple
        fed = 0

        def count(data: bytes, feed: Any = conn.feed) -> None:
            nonlocal fed
            fed += 1
            feed(data)

        conn.feed = count  # type: ignore[method-assign]
        seen: list[Any] = []
        conn.start(b"POST / HTTP/1.1\r\n\r\n", RID.decode())
        for data in reads:
            conn.data_received(data)
            seen.append(_state(conn))
        for data in later:
            conn.data_received(data)
            seen.append(_state(conn))
        if conn.reusable():
            conn.busy = False  # as the pool's release
            conn.start(b"POST / HTTP/1.1\r\n\r\n", NEXT_RID.decode())
            conn.data_received(ANSWER.replace(b"{RID}", NEXT_RID))
            seen.append(_state(conn))
        seen.append(("parser fed", fed > 0) if not simple else ("-",))
        return seen


async def _compare(reads: list[bytes], later: Sequence[bytes] = (), budget: int = 1 << 20) -> bool:
    """Both ways give the same states; True when the simple path took the answer."""
    fast = await _run(True, reads, later, budget)
    slow = await _run(False, reads, later, budget)
    assert fast[:-1] == slow[:-1], (reads, later)
    return fast[-1] == ("-",) and await _took_simple(reads)


async def _took_simple(reads: list[bytes]) -> bool:
    fed: list[bytes] = []
    async with _connection() as conn:
        conn.feed = fed.append  # type: ignore[method-assign]
        conn.start(b"POST / HTTP/1.1\r\n\r\n", RID.decode())
        conn.data_received(reads[0])
    return not fed


def _suite_answers() -> Iterator[tuple[str, bytes]]:
    for name, (steps, _) in CASES.items():
        data = b"".join(s for s in steps if isinstance(s, bytes)).replace(b"{RID}", RID)
        if data:
            yield name, data
    for name, steps in STRICTER.items():
        yield name, b"".join(steps).replace(b"{RID}", RID)
    for sse in (False, True):
        for rid in (RID, b"someone-else", None):
            one = _answer(b"c1r1", rid, sse)
            yield f"desync-{sse}-{rid!r}", one
            yield f"desync-twice-{sse}-{rid!r}", one + _answer(b"STOLEN-DELAYED-c1r1", rid, sse)


PLAIN = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-request-id: rid-7\r\n"
BODY = b'{"ok": true}'
# Lines and heads at the pattern's edges: each must read the same through httptools.
EDGES: dict[str, bytes] = {
    "plain": PLAIN + b"Content-Length: 12\r\n\r\n" + BODY,
    "length-first": b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nx-request-id: rid-7\r\n\r\n" + BODY,
    "no-echo": b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + BODY,
    "other-echo": b"HTTP/1.1 200 OK\r\nx-request-id: rid-6\r\nContent-Length: 12\r\n\r\n" + BODY,
    "empty-body": PLAIN + b"Content-Length: 0\r\n\r\n",
    "leading-zeros": PLAIN + b"Content-Length: 0012\r\n\r\n" + BODY,
    "no-space": PLAIN + b"content-length:12\r\n\r\n" + BODY,
    "spaces": PLAIN + b"CONTENT-LENGTH:    12\r\n\r\n" + BODY,
    "tab-after-colon": PLAIN + b"Content-Length:\t12\r\n\r\n" + BODY,
    "trailing-space": PLAIN + b"Content-Length: 12 \r\n\r\n" + BODY,
    "value-trailing-space": PLAIN + b"X-A: b \r\nContent-Length: 12\r\n\r\n" + BODY,
    "value-spaces-inside": PLAIN + b"X-A: a  b\r\nContent-Length: 12\r\n\r\n" + BODY,
    "empty-value": PLAIN + b"X-A:\r\nContent-Length: 12\r\n\r\n" + BODY,
    "colon-in-value": PLAIN + b"X-A: a: b\r\nContent-Length: 12\r\n\r\n" + BODY,
    "json-with-charset": PLAIN.replace(b"json", b"JSON; charset=utf-8") + b"Content-Length: 12\r\n\r\n" + BODY,
    "sse-with-length": PLAIN.replace(b"application/json", b"text/event-stream") + b"Content-Length: 12\r\n\r\n" + BODY,
    "connection-close": PLAIN + b"Connection: close\r\nContent-Length: 12\r\n\r\n" + BODY,
    "connection-keep-alive": PLAIN + b"Connection: keep-alive\r\nContent-Length: 12\r\n\r\n" + BODY,
    "keep-alive-header": PLAIN + b"Keep-Alive: timeout=5\r\nContent-Length: 12\r\n\r\n" + BODY,
    "proxy-connection": PLAIN + b"Proxy-Connection: close\r\nContent-Length: 12\r\n\r\n" + BODY,
    "upgrade": PLAIN + b"Upgrade: h2c\r\nContent-Length: 12\r\n\r\n" + BODY,
    "connection-prefix": PLAIN + b"Connectionx: close\r\nContent-Length: 12\r\n\r\n" + BODY,
    "te-chunked": PLAIN + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(BODY) + b"0\r\n\r\n",
    "status-204-length": b"HTTP/1.1 204 No Content\r\nx-request-id: rid-7\r\nContent-Length: 0\r\n\r\n",
    "status-304-length": b"HTTP/1.1 304 Not Modified\r\nx-request-id: rid-7\r\nContent-Length: 0\r\n\r\n",
    "status-404": b"HTTP/1.1 404 Not Found\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "status-599": b"HTTP/1.1 599 X\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "status-600": b"HTTP/1.1 600 X\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "status-199": b"HTTP/1.1 199 X\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "reason-colon": b"HTTP/1.1 200 O:K\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "reason-trailing-space": b"HTTP/1.1 200 OK \r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "reason-empty": b"HTTP/1.1 200 \r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "http10": b"HTTP/1.0 200 OK\r\nx-request-id: rid-7\r\nContent-Length: 12\r\n\r\n" + BODY,
    "one-byte-short": PLAIN + b"Content-Length: 13\r\n\r\n" + BODY,
    "one-byte-more": PLAIN + b"Content-Length: 11\r\n\r\n" + BODY,
    "crlf-after": PLAIN + b"Content-Length: 12\r\n\r\n" + BODY + b"\r\n",
    "too-big": PLAIN + b"Content-Length: 5000\r\n\r\n" + b"x" * 5000,
    "121-lines": PLAIN + b"".join(b"X-%d: 1\r\n" % i for i in range(58)) + b"Content-Length: 12\r\n" + b"".join(b"Y-%d: 1\r\n" % i for i in range(60)) + b"\r\n" + BODY,
    "122-lines": PLAIN + b"".join(b"X-%d: 1\r\n" % i for i in range(58)) + b"Content-Length: 12\r\n" + b"".join(b"Y-%d: 1\r\n" % i for i in range(61)) + b"\r\n" + BODY,
    "128-lines": PLAIN + b"".join(b"X-%d: 1\r\n" % i for i in range(125)) + b"Content-Length: 12\r\n\r\n" + BODY,
    "129-lines": PLAIN + b"".join(b"X-%d: 1\r\n" % i for i in range(126)) + b"Content-Length: 12\r\n\r\n" + BODY,
    "8k-value": PLAIN + b"X-A: " + b"v" * 8100 + b"\r\nContent-Length: 12\r\n\r\n" + BODY,
    "9k-value": PLAIN + b"X-A: " + b"v" * 9000 + b"\r\nContent-Length: 12\r\n\r\n" + BODY,
    "odd-token-name": PLAIN + b"X!#$%&'*+-.^_`|~9: 1\r\nContent-Length: 12\r\n\r\n" + BODY,
    "two-echoes": PLAIN + b"X-Request-ID: rid-6\r\nContent-Length: 12\r\n\r\n" + BODY,
    "content-encoding": PLAIN + b"Content-Encoding: gzip\r\nContent-Length: 12\r\n\r\n" + BODY,
    "length-huge": PLAIN + b"Content-Length: 999999999999999\r\n\r\n" + BODY,
    "length-16-digits": PLAIN + b"Content-Length: 1000000000000000\r\n\r\n" + BODY,
}  # fmt: skip
LATER = [b"", b"\r\n", b"x", ANSWER.replace(b"{RID}", RID), b"HTTP/1.1 200 OK\r\n"]


@pytest.mark.parametrize("name", list(EDGES))
async def test_edge_cases_read_the_same_both_ways(name: str) -> None:
    data = EDGES[name]
    for later in LATER:
        await _compare([data], [later] if later else [])
    for budget in (8, 16, 1 << 20):  # over the budget, at it, far under
        await _compare([data], [], budget)


async def test_the_plain_answer_takes_the_simple_path() -> None:
    """Not vacuous: the common answers are read without the parser."""
    for name in (
        "plain",
        "length-first",
        "no-echo",
        "empty-body",
        "json-with-charset",
        "121-lines",
    ):
        assert await _compare([EDGES[name]]), name
    for name in ("te-chunked", "connection-close", "one-byte-more", "status-204-length"):
        assert not await _compare([EDGES[name]]), name


@pytest.mark.parametrize("name", [n for n, _ in _suite_answers()])
async def test_suite_answers_read_the_same_both_ways(name: str) -> None:
    data = dict(_suite_answers())[name]
    await _compare([data])
    await _compare([data], [ANSWER.replace(b"{RID}", RID)])
    # Split anywhere, the first read is not a whole answer: both go to the parser alike.
    for cut in range(1, len(data), max(1, len(data) // 7)):
        await _compare([data[:cut], data[cut:]])


# Pieces a random head is built from: each a line the pattern may or may not admit.
LINES = [
    b"Content-Type: application/json", b"content-type: text/event-stream", b"x-request-id: rid-7",
    b"X-Request-Id: rid-6", b"x-request-id:rid-7", b"Content-Length: 12", b"Content-Length: 11",
    b"Content-Length:  12", b"Content-Length: 012", b"Content-Length: +12", b"Content-Length: 1 2",
    b"Connection: close", b"Connection: keep-alive", b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: identity", b"Upgrade: websocket", b"Proxy-Connection: keep-alive",
    b"Keep-Alive: 5", b"X-A: a\tb", b"X-A:\ta", b"X-A: a ", b"X-A:", b"X-A : 1", b" folded",
    b"X-A: caf\xc3\xa9", b"X-A: a\x7fb", b"X-A: a\x00b", b": empty-name", b"X@A: 1",
    b"Retry-After: 3", b"Cache-Control: no-cache", b"Content-Encoding: identity", b"Date: x",
    b"Server: uvicorn", b"X-Ratelimit: 1, 2, 3",
]  # fmt: skip
NICE = [
    line
    for line in LINES
    if line.startswith(
        (b"Content-Type", b"x-request-id", b"Retry", b"Cache", b"Date", b"Server", b"X-Ratelimit")
    )
]
STATUS_LINES = [
    b"HTTP/1.1 200 OK", b"HTTP/1.1 200", b"HTTP/1.1 200 ", b"HTTP/1.1 201 Created",
    b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 100 Continue",
    b"HTTP/1.1 101 Switching", b"HTTP/1.1 429 Too Many", b"HTTP/1.1 503 Busy", b"HTTP/1.0 200 OK",
    b"HTTP/1.1 999 Odd", b"HTTP/1.1 20 OK", b"HTTP/2 200 OK", b"HTTP/1.1 200 O\tK",
]  # fmt: skip


def _random_answer(rng: random.Random) -> bytes:
    """Mostly a head the pattern admits, with one odd piece now and then."""
    odd = rng.random
    lines = [rng.choice(STATUS_LINES) if odd() < 0.3 else b"HTTP/1.1 200 OK"]
    lines += [rng.choice(LINES if odd() < 0.2 else NICE) for _ in range(rng.randint(0, 6))]
    if odd() < 0.9:
        lines.insert(rng.randint(1, len(lines)), b"Content-Length: 12")
    ending = b"\n" if odd() < 0.05 else b"\r\n"
    body = rng.choice([BODY[:11], BODY + b"\r\n", BODY + ANSWER, b""]) if odd() < 0.3 else BODY
    return ending.join(lines) + ending + ending + body


async def test_random_answers_read_the_same_both_ways() -> None:
    rng = random.Random(34)
    took = 0
    for _ in range(3000):
        data = _random_answer(rng)
        if await _compare([data], [rng.choice(LATER)]):
            took += 1
    assert took > 500  # not vacuous: a share of them took the simple path


async def test_trailers_do_not_count_as_header_lines() -> None:
    """The line cap (128) is the head's: 100 header lines and 40 trailer lines are an
    answer (the parser's line count must not run on into the trailers)."""
    head = (
        PLAIN
        + b"".join(b"X-%d: 1\r\n" % i for i in range(98))
        + b"Transfer-Encoding: chunked\r\n\r\n"
    )
    trailers = b"".join(b"T-%d: 1\r\n" % i for i in range(40))
    data = head + chunked(BODY) + b"0\r\n" + trailers + b"\r\n"
    for simple in (True, False):
        state = (await _run(simple, [data], [], 1 << 20))[0]
        assert state[4] is True and state[7] is None and state[12] == BODY, state  # complete, sound


def test_the_simple_form_and_what_is_not_it() -> None:
    assert simple_answer(EDGES["plain"], MAX_FIELD_BYTES) == (
        200,
        [("Content-Type", "application/json"), ("x-request-id", "rid-7"), ("Content-Length", "12")],
        12,
        BODY,
    )
    assert simple_answer(EDGES["value-trailing-space"], MAX_FIELD_BYTES)[1][2] == ("X-A", "b ")  # type: ignore[index]
    for name in ("te-chunked", "connection-close", "one-byte-more", "one-byte-short",
                 "status-204-length", "http10", "tab-after-colon", "9k-value", "122-lines"):  # fmt: skip
        assert simple_answer(EDGES[name], MAX_FIELD_BYTES) is None, name


# --- a repeated head (SimpleReader): the same result as the pattern, every time --------

IDS = ["rid-8", "r", "0123456789abcdef0123456789abcdef", "a b", "a ", "x" * 200, "rid-7"]
BAD_IDS = ["", " rid", "rid\r\nX-A: 1", "rid\tx", "caf\u00e9", "rid\x7f", "rid\r\n\r\n"]


def _again(data: bytes, old_id: bytes, new_id: bytes, body: bytes) -> bytes:
    """`data`'s head with the echo and the length of another answer, and its body."""
    end = data.find(b"\r\n\r\n") + 4
    head = data[:end].replace(old_id, new_id)
    head = re.sub(rb"(?i)(content-length: *)[0-9]+", rb"\g<1>%d" % len(body), head)
    return head + body


def _mutants(rng: random.Random, data: bytes) -> Iterator[bytes]:
    """`data` with one byte of its head changed, dropped or doubled, at random places."""
    end = data.find(b"\r\n\r\n") + 4
    for _ in range(6):
        at = rng.randrange(max(1, end))
        byte = bytes([rng.choice(b" \t\r\n:0aZ\x00\x80-")])
        yield data[:at] + byte + data[at + 1 :]
        yield data[:at] + data[at + 1 :]
        yield data[:at] + data[at : at + 1] * 2 + data[at + 1 :]


@pytest.fixture
def pattern_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every answer the pattern itself read (the rest were read as a repeated head)."""
    seen: list[bytes] = []

    def counted(data: bytes, max_head: int) -> Any:
        seen.append(data)
        return simple_answer(data, max_head)

    monkeypatch.setattr(simple_module, "simple_answer", counted)
    return seen


def test_a_repeated_head_reads_as_the_pattern_reads_it(pattern_reads: list[bytes]) -> None:
    """Any answer after any other, with any id: the reader's result is the pattern's.
    The heads: random ones, then each again with another id and length (the repeats),
    with one byte changed (near misses), or with an id the pattern does not admit."""
    rng = random.Random(36)
    repeats = 0
    for _ in range(1500):
        first = _random_answer(rng)
        seconds: list[tuple[bytes, str]] = []
        for rid in IDS + BAD_IDS:
            body = BODY * rng.randint(0, 3)
            again = _again(first, RID, rid.encode("utf-8", "replace"), body)
            seconds.append((again, rid))
            seconds += [(m, rid) for m in _mutants(rng, again)]
        for data, rid in seconds:
            reader = SimpleReader(MAX_FIELD_BYTES)  # its last head: `first`
            assert reader.read(first, RID.decode()) == simple_answer(first, MAX_FIELD_BYTES)
            before = len(pattern_reads)
            assert reader.read(data, rid) == simple_answer(data, MAX_FIELD_BYTES), (data, rid)
            repeats += len(pattern_reads) == before
    assert repeats > 500, repeats  # not vacuous: the repeats were read without the pattern


def test_a_repeated_head_must_echo_this_request(pattern_reads: list[bytes]) -> None:
    """An answer that repeats the last head with the last id, or another request's, is
    read by the pattern: its echo is not this request's, and `_take_head` refuses it."""
    reader = SimpleReader(MAX_FIELD_BYTES)
    plain = EDGES["plain"]
    assert reader.read(plain, "rid-7") is not None
    assert reader.read(plain.replace(b"rid-7", b"rid-8"), "rid-8") is not None
    assert len(pattern_reads) == 1  # the repeat with this request's id: no pattern
    answer = reader.read(plain, "rid-9")  # the echo of an earlier request
    assert answer is not None and ("x-request-id", "rid-7") in answer[1]
    assert len(pattern_reads) == 2


def test_bad_bytes_in_a_repeated_head_are_not_taken(pattern_reads: list[bytes]) -> None:
    """Adversarial: a head over the field cap, bytes the pattern refuses where the holes
    were, a body longer or shorter than said: none is taken, and none as a repeat."""
    reader = SimpleReader(MAX_FIELD_BYTES)
    plain = EDGES["plain"]
    assert reader.read(plain, "rid-7") is not None
    long_id = "i" * MAX_FIELD_BYTES  # the head over the cap: refused before any work
    assert reader.read(plain.replace(b"rid-7", long_id.encode()), long_id) is None
    for bad in (b"rid-8\r\nTransfer-Encoding: chunked", b"rid-8\x00", b"rid-8\xff"):
        assert reader.read(plain.replace(b"rid-7", bad), bad.decode("latin-1")) is None
    assert reader.read(plain + b"x", "rid-7") is None  # one byte more than its length
    assert reader.read(plain[:-1], "rid-7") is None  # one short
    assert reader.read(plain.replace(b": 12", b": 0012"), "rid-7") is not None  # pattern's
    assert len(pattern_reads) == 8  # each of them read by the pattern, none as a repeat


async def test_answers_on_a_kept_connection_read_the_same_both_ways() -> None:
    """Many exchanges on one connection, each answer the last one's head with its own id
    and length (or a near miss): the same states through the parser."""
    rng = random.Random(7)
    for _ in range(40):
        first = _random_answer(rng)
        steps = [first]
        for i in range(6):
            body = BODY * rng.randint(0, 3)
            again = _again(steps[-1], b"rid-%d" % (7 + i), b"rid-%d" % (8 + i), body)
            steps.append(rng.choice([again, *_mutants(rng, again)][:3]))
        assert await _kept(True, steps) == await _kept(False, steps), steps


async def _kept(simple: bool, answers: list[bytes]) -> list[Any]:
    seen = []
    async with _connection() as conn:
        conn.simple_heads = simple
        for i, data in enumerate(answers):
            conn.start(b"POST / HTTP/1.1\r\n\r\n", f"rid-{7 + i}")
            conn.data_received(data)
            seen.append(_state(conn))
            if not conn.reusable():
                break
            conn.busy = False  # as the pool's release
    return seen


def test_a_head_that_never_repeats_is_kept_only_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose head changes every answer (a per-answer header) costs a kept head
    once in `SKIP_AFTER_MISS + 1` answers, not every answer; a repeat is kept again."""
    kept = 0
    keep = SimpleReader._keep

    def counted(self: SimpleReader, *args: Any) -> Any:
        nonlocal kept
        kept += 1
        return keep(self, *args)

    monkeypatch.setattr(SimpleReader, "_keep", counted)
    reader = SimpleReader(MAX_FIELD_BYTES)
    for i in range(170):
        data = EDGES["plain"].replace(b"rid-7", b"rid-%d" % i).replace(b"OK", b"K%d" % i)
        assert reader.read(data, f"rid-{i}") == simple_answer(data, MAX_FIELD_BYTES)
    assert kept == 170 // (simple_module.SKIP_AFTER_MISS + 1)
    for i in range(170, 200):  # the same head from now on: kept, then repeated
        data = EDGES["plain"].replace(b"rid-7", b"rid-%d" % i)
        assert reader.read(data, f"rid-{i}") == simple_answer(data, MAX_FIELD_BYTES)
    assert reader._hit
