"""Issue 15's edge findings, each against both services (the real apps on loopback):
text that cannot be UTF-8, integers beyond 64 bits, `Content-Encoding` on chunked and
sized bodies, Bearer headers in bytes that are not UTF-8, one answer to the same
headers from both services, the worker key the router sends, and trickling bodies
that must not hold admission slots. Each case failed on the code before the fix (the
comment says how)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hmac
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from shared.config import RouterConfig
from shared.serving.auth import KeySet, bearer_token
from tests.fuzz.conftest import BODY_LIMIT, Services, start_router, start_worker, worker_config
from tests.fuzz.test_bad_input import GOOD, assert_openai_error, post
from tests.waiting import wait_until

TARGETS = ["worker", "router"]
CHAT = "/v1/chat/completions"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def chat(content: Any, **kw: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}
    return json.dumps(body).encode()  # json.dumps writes a lone surrogate as \ud800


# Was: router 200-forwarded, every worker 500 (its tokenizer encodes UTF-8) → breakers open.
SURROGATES = [
    ("chat_content", CHAT, chat("a\ud800b"), "messages.0.content"),
    ("chat_part", CHAT, chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]),
     "messages.0.content.1.text"),
    ("chat_name", CHAT, json.dumps({"messages": [{"role": "user", "content": "x", "name": "\ud83d"}]}).encode(),
     "messages.0.name"),
    ("prompt_list", "/v1/completions", json.dumps({"prompt": ["\ud800"], "max_tokens": 2}).encode(), "prompt.0"),
    ("stop", "/v1/completions", json.dumps({"prompt": "x", "stop": "\ud800", "max_tokens": 2}).encode(), "stop"),
    ("generate_text", "/generate", json.dumps({"text": "\udc80"}).encode(), "text"),
]  # fmt: skip
# Was: 500 on both services (json.loads' 4,300-digit limit raised an uncaught ValueError),
# and a seed beyond 64 bits reached the engine.
BIG_INTS = [
    ("5000_digit_seed", "/v1/completions", b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", "seed"),
    ("5000_digit_nested", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "x": [1, -' + b"9" * 5000 + b"]}", "x.1"),
    ("seed_2_70", "/v1/completions", json.dumps({"prompt": "x", "seed": 2**70}).encode(), "seed"),
    ("token_id_2_64", "/v1/completions", json.dumps({"prompt": [1, 2**64]}).encode(), "prompt.1"),
    ("sampling_params_seed", "/generate", json.dumps({"text": "x", "sampling_params": {"seed": -(2**63) - 1}}).encode(),
     "sampling_params.seed"),
]  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("name", "path", "raw", "param"),
    SURROGATES + BIG_INTS,
    ids=[c[0] for c in SURROGATES + BIG_INTS],
)
async def test_unencodable_text_and_huge_integers_are_400_naming_the_field(
    services: Services, http: aiohttp.ClientSession, target: str,
    name: str, path: str, raw: bytes, param: str,
) -> None:  # fmt: skip
    base = getattr(services, target)
    status, body = await post(http, base + path, raw)
    assert_openai_error(status, body, 400, None)
    assert body["error"]["param"] == param, body
    ok_status, _ = await post(http, base + "/v1/completions", json.dumps(GOOD).encode())
    assert ok_status == 200


async def test_valid_surrogate_pairs_and_64_bit_integers_still_pass(
    services: Services, http: aiohttp.ClientSession
) -> None:
    body = chat("emoji \ud83d\ude00", seed=2**63 - 1)  # an escaped pair is one character
    for base in (services.worker, services.router):
        status, answer = await post(http, base + CHAT, body)
        assert status == 200, answer


def _encoded(kind: str, raw: bytes) -> bytes:
    return gzip.compress(raw) if kind == "gzip" else zlib.compress(raw)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["gzip", "deflate"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_compressed_bodies_are_decoded_and_forwarded_decoded(
    services: Services, http: aiohttp.ClientSession, target: str, kind: str, framing: str
) -> None:
    """Was: chunked + gzip → the router forwarded the decoded body still labelled gzip, so
    every worker answered 500; Content-Length + gzip → the router read that many bytes
    of the decoded body, so gzip clients always got 400."""
    data = _encoded(kind, json.dumps({**GOOD, "prompt": "compressed " * 50}).encode())

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 7):
            yield data[i : i + 7]

    payload: Any = data if framing == "content-length" else chunks()
    headers = {"Content-Encoding": kind, "Content-Type": "application/json"}
    async with http.post(getattr(services, target) + "/v1/completions", data=payload,
                         headers=headers) as r:  # fmt: skip
        answer = await r.json()
    assert r.status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("target", TARGETS)
async def test_compression_bombs_bad_data_and_other_encodings_are_refused(
    services: Services, target: str
) -> None:
    url = getattr(services, target) + "/v1/completions"
    # aiohttp closes a connection whose body it could not decode: one connection a request.
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (BODY_LIMIT * 64) + b'"}')
    assert len(bomb) < BODY_LIMIT
    for data, encoding, status, code in [
        (bomb, "gzip", 413, "body_too_large"),
        (b"not gzip at all", "gzip", 400, None),
        (json.dumps(GOOD).encode(), "compress", 415, "unsupported_content_encoding"),
        (json.dumps(GOOD).encode(), "gzip, gzip", 415, "unsupported_content_encoding"),
    ]:
        got, body = await post(http, url, data, {"Content-Encoding": encoding})
        assert got == status, (encoding, body)
        if code is not None:
            assert body["error"]["code"] == code
    assert (await post(http, url, json.dumps(GOOD).encode()))[0] == 200
    await http.close()


async def _raw_request(port: int, head: bytes, body: bytes = b"{}") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def test_same_authorization_headers_get_the_same_answer_from_both_services() -> None:
    """Was: the worker stripped a literal "Bearer " (a lower-case scheme was refused) and
    encoded a non-UTF-8 token with a plain .encode() (the router answered 500)."""
    key = "sk-both-31f9"
    worker = await start_worker(worker_config(api_keys=(key,)))
    router = await start_router(RouterConfig(host="127.0.0.1", api_keys=(key,)))
    cases = [
        (b"Bearer " + key.encode(), 404),  # past auth: no such path
        (b"bearer  " + key.encode() + b" ", 404),
        (b"BEARER " + key.encode(), 404),
        (b"Bearer " + key.encode() + b"x", 401),
        (b"Bearer " + key[:-1].encode(), 401),
        (b"Basic " + key.encode(), 401),
        (b"Bearer \xff\xfe" + key.encode(), 401),
        (b"Bearer " + "ключ".encode("latin-1", "replace"), 401),
        (b"Bearer \xc3\xa9t\xc3\xa9", 401),  # valid UTF-8, wrong key
        (b"Bearer", 401),
    ]
    try:
        for header, want in cases:
            answers = []
            for server in (worker, router):
                head = (
                    b"POST /v1/nothing-here HTTP/1.1\r\nHost: x\r\nAuthorization: "
                    + header
                    + b"\r\n"
                )
                raw = await _raw_request(server.port, head)
                status = int(raw.split(b" ", 2)[1])
                answers.append(status)
                if status == 401:
                    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
                    assert body["error"]["code"] == "invalid_api_key"
                    assert b"WWW-Authenticate: Bearer" in raw
            assert answers == [want, want], (header, answers)
    finally:
        await router.close()
        await worker.close()


def test_keys_compared_as_fixed_length_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit and no length leak: every key is compared, always 32 bytes to 32."""
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = KeySet(["short", "a-much-longer-key-" * 8, "mid-length"])
    for token, want in [("short", True), ("x", False), ("mid-length", True), ("y" * 999, False)]:
        seen.clear()
        assert keys.matches(token) is want
        assert seen == [(32, 32)] * 3
    assert bearer_token({"Authorization": "bEaReR tok"}) == "tok"
    assert bearer_token({"Authorization": "Bearer \udcff"}) is None


async def test_router_sends_its_worker_key_and_workers_require_it(
    http: aiohttp.ClientSession,
) -> None:
    """Was: workers served /flush_cache and inference to anyone; the router had no key to send."""
    worker = await start_worker(worker_config(api_keys=("sk-worker-9a1",)))
    wurl = str(worker.make_url("")).rstrip("/")
    router = await start_router(
        RouterConfig(host="127.0.0.1", worker_urls=(wurl,), worker_api_key="sk-worker-9a1")
    )
    rurl = str(router.make_url("")).rstrip("/")
    try:
        for path, body in [("/flush_cache", b"{}"), ("/v1/completions", json.dumps(GOOD).encode())]:
            assert (await post(http, wurl + path, body))[0] == 401
        async with http.get(wurl + "/health") as r:
            assert r.status == 200  # probes stay open
        status, answer = await post(http, rurl + "/v1/completions", json.dumps(GOOD).encode())
        assert status == 200, answer
        async with http.get(rurl + "/v1/models") as r:  # the probe of a static worker too
            assert [m["id"] for m in (await r.json())["data"]] == ["sim"]
        headers = {"Authorization": "Bearer sk-worker-9a1"}
        assert (await post(http, wurl + "/flush_cache", b"{}", headers))[0] == 200
    finally:
        await router.close()
        await worker.close()


async def _trickle(port: int, stop: asyncio.Event) -> bytes:
    """A client that declares a body and sends it a byte every 0.2 s, never finishing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
    answer = b""
    try:
        while not stop.is_set() and not reader.at_eof() and b"}" not in answer:
            writer.write(b" ")
            await writer.drain()
            with contextlib.suppress(TimeoutError):  # a cancelled read(n) loses nothing
                answer += await asyncio.wait_for(reader.read(65536), 0.2)
        return answer
    except ConnectionError:
        return answer or b"reset"
    finally:
        writer.close()


@pytest.mark.parametrize("target", TARGETS)
async def test_trickling_bodies_hold_no_slot_and_time_out(
    http: aiohttp.ClientSession, target: str
) -> None:
    """Was: the router read bodies inside the admission slot with no deadline, so 6
    trickling clients against max_concurrent 4 had everyone else refused with 429."""
    worker = await start_worker(worker_config(body_read_timeout=1.5))
    wurl = str(worker.make_url("")).rstrip("/")
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(wurl,), max_concurrent=4, max_queue=0, body_read_timeout=1.5,
    ))  # fmt: skip
    server = router if target == "router" else worker
    base = str(server.make_url("")).rstrip("/")
    stop = asyncio.Event()
    tricklers = [asyncio.create_task(_trickle(server.port, stop)) for _ in range(6)]
    try:
        # every trickler is connected and mid-body
        await wait_until(lambda: len(server.runner.server.connections) >= 6)  # type: ignore[union-attr]
        good = await asyncio.gather(*(
            post(http, base + "/v1/completions", json.dumps({**GOOD, "prompt": f"g{i}"}).encode())
            for i in range(4)
        ))  # fmt: skip
        assert [s for s, _ in good] == [200] * 4, good
        answers = await asyncio.wait_for(asyncio.gather(*tricklers), 10)
        for raw in answers:
            assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
            assert b"body_timeout" in raw
    finally:
        stop.set()
        await asyncio.gather(*tricklers, return_exceptions=True)
        await router.close()
        await worker.close()


@pytest.mark.parametrize("target", TARGETS)
async def test_generate_streams_each_token_once(
    services: Services, http: aiohttp.ClientSession, target: str
) -> None:
    """Was: every /generate chunk resent the whole text and ids so far (SGLang's
    cumulative form): 8k tokens sent 271 MB. Now each chunk carries only what is new, so
    2,000 tokens cost ~2,000 small events (cumulative: ~15 MB)."""
    body = {"text": "count", "stream": True, "sampling_params": {
        "max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    async with http.post(getattr(services, target) + "/generate", json=body) as r:
        raw = await r.read()
    assert r.status == 200
    events = [json.loads(x[6:]) for x in raw.split(b"\n\n") if x.startswith(b"data: {")]
    assert sum(len(e["output_ids"]) for e in events) == 2000
    assert len(raw) < 400 * 2000, len(raw)  # linear: a few hundred bytes a token at most
