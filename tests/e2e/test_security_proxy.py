"""What crosses the proxy: hop-by-hop headers and credentials in both directions,
admission limits (429 + Retry-After), a poison request's effect on the fleet, and
what reaches the logs of real processes at the default level."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from loadtests.load.cluster import Cluster, WorkerSpec
from shared.procs import http_json
from shared.redis_server import free_port
from tests.e2e.edge import (
    BEARER,
    BODY,
    CLIENT_KEY,
    StartRouter,
    http_fixture,
    request,
    router_fixture,
    worker_url_fixture,
)
from tests.waiting import wait_until

FIXTURES = (http_fixture, router_fixture, worker_url_fixture)  # registered by import

RESPONSE_BODY = json.dumps({"object": "text_completion", "choices": []}).encode()
UPSTREAM_HEADERS = [  # what the raw upstream answers with, besides Content-Length
    ("Content-Type", "application/json"), ("Connection", "keep-alive, X-Up-Hop"),
    ("X-Up-Hop", "must-not-pass"), ("Keep-Alive", "timeout=5"),
    ("Proxy-Authenticate", "Basic"), ("Trailer", "X-T"), ("Upgrade", "h2c"),
    ("Set-Cookie", "upstream=secret"), ("X-Upstream-End-To-End", "kept"),
]  # fmt: skip


@dataclass
class RawUpstream:
    """An HTTP/1.1 server on a raw socket: records request headers, answers fixed ones."""

    seen: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (x.partition(":") for x in lines if x)
                }
                self.seen.append(headers)
                await reader.readexactly(int(headers.get("content-length", "0")))
                out = [f"{k}: {v}" for k, v in UPSTREAM_HEADERS]
                out.append(f"Content-Length: {len(RESPONSE_BODY)}")
                writer.write(("HTTP/1.1 200 OK\r\n" + "\r\n".join(out) + "\r\n\r\n").encode())
                writer.write(RESPONSE_BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    up = RawUpstream()
    port = free_port()
    server = await asyncio.start_server(up.handle, "127.0.0.1", port)
    up.url = f"http://127.0.0.1:{port}"
    yield up
    server.close()


CLIENT_HEADERS = {
    "Authorization": f"Bearer {CLIENT_KEY}", "Cookie": "session=client-secret",
    "Proxy-Authorization": "Basic abc", "Connection": "keep-alive, X-Client-Hop",
    "X-Client-Hop": "must-not-pass", "Keep-Alive": "timeout=5", "TE": "trailers",
    "X-Request-Id": "kept-123",
}  # fmt: skip
STRIPPED = {"authorization", "cookie", "proxy-authorization", "x-client-hop", "keep-alive", "te"}


async def test_hop_by_hop_and_credentials_are_stripped_both_ways(
    router: StartRouter, upstream: RawUpstream, http: aiohttp.ClientSession
) -> None:
    base = await router(worker_urls=(upstream.url,), api_keys=(CLIENT_KEY,))
    async with http.post(base + "/v1/completions", json=BODY, headers=CLIENT_HEADERS) as r:
        assert r.status == 200
        got = {k.lower() for k in r.headers}
        assert await r.read() == RESPONSE_BODY
    seen = upstream.seen[-1]
    assert STRIPPED.isdisjoint(seen), seen
    assert seen.get("x-request-id") == "kept-123"  # end-to-end headers pass
    assert "x-upstream-end-to-end" not in got  # response headers pass by allow-list only
    assert got.isdisjoint({"x-up-hop", "proxy-authenticate", "trailer", "upgrade", "set-cookie"})
    assert r.headers.get("Keep-Alive") is None


async def test_client_authorization_forwarded_only_when_configured(
    router: StartRouter, upstream: RawUpstream, http: aiohttp.ClientSession
) -> None:
    base = await router(
        worker_urls=(upstream.url,), api_keys=(CLIENT_KEY,), forward_authorization=True
    )
    assert (await request(http, "POST", base + "/v1/completions", BODY, BEARER))[0] == 200
    assert upstream.seen[-1]["authorization"] == f"Bearer {CLIENT_KEY}"
    assert "cookie" not in upstream.seen[-1]


async def test_full_queue_and_queue_timeout_answer_429_with_retry_after(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession
) -> None:
    # One slot, a queue of one: the first runs (≈0.5 s), the second waits, the rest bounce.
    base = await router(
        worker_urls=(worker_url,), max_concurrent=1, max_queue=1, queue_timeout=20.0
    )
    slow = {"prompt": "slow", "max_tokens": 20}
    results = await asyncio.gather(
        *(request(http, "POST", base + "/v1/completions", slow) for _ in range(6))
    )
    statuses = sorted(s for s, _, _ in results)
    assert statuses == [200, 200, 429, 429, 429, 429], statuses
    for status, body, headers in results:
        if status == 429:
            assert body["error"]["type"] == "rate_limit_error"
            assert int(headers["Retry-After"]) >= 1
    # A queue timeout shorter than the running request: the waiter is refused, not stuck.
    base = await router(worker_urls=(worker_url,), max_concurrent=1, max_queue=4, queue_timeout=0.1)
    first, second = await asyncio.gather(
        request(http, "POST", base + "/v1/completions", slow),
        request(http, "POST", base + "/v1/completions", slow),
    )
    assert sorted([first[0], second[0]]) == [200, 429]


async def test_poison_requests_cannot_take_the_fleet_out(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession
) -> None:
    """A request every worker fails on (it was a lone surrogate: worker 500) must not open
    every breaker: the proxy counts a worker's 5xx as the worker's failure, so such input
    has to be refused at the router's edge."""
    base = await router(worker_urls=(worker_url,), breaker_failures=3)
    poison = b'{"prompt": "\\ud800", "max_tokens": 2}'
    for _ in range(3):
        async with http.post(base + "/v1/completions", data=poison) as r:
            assert r.status < 500
    status, _, _ = await request(http, "POST", base + "/v1/completions", BODY)
    assert status == 200


SECRET_PROMPT = "PROMPT-SECRET-q8w7e6"
SECRET_KEY = "sk-SECRET-z9x8c7"


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_no_key_or_prompt_text_in_logs_at_default_level() -> None:
    fleet = Cluster(redis_password="redis-SECRET-pw")
    try:
        await asyncio.to_thread(fleet.start_worker, "w0", WorkerSpec(decode_ms=1.0))
        headers = {"Authorization": f"Bearer {SECRET_KEY}"}
        router = await asyncio.to_thread(
            fleet.start_router, {"api_keys": SECRET_KEY, "admin_key": "sk-SECRET-admin"},
            (), 1, headers,
        )  # fmt: skip
        url = router.url + "/v1/completions"
        traffic = [  # answered, refused, invalid, unknown model, streamed, wrong keys
            ({"prompt": SECRET_PROMPT, "max_tokens": 3}, headers),
            (
                {"prompt": SECRET_PROMPT, "max_tokens": 3},
                {"Authorization": f"Bearer {SECRET_KEY}x"},
            ),
            ({"prompt": SECRET_PROMPT, "max_tokens": -3}, headers),
            ({"prompt": SECRET_PROMPT, "model": SECRET_PROMPT}, headers),
            ({"prompt": SECRET_PROMPT, "max_tokens": 3, "stream": True}, headers),
        ]
        for body, h in traffic:
            await asyncio.to_thread(http_json, url, "POST", body, h)
        await asyncio.to_thread(http_json, router.url + "/workers", "POST",
                                {"url": "http://u:sk-SECRET-pw@h:1"}, {"Authorization": "Bearer sk-SECRET-admin"})  # fmt: skip
        # A Redis blip makes both services log warnings: still no password in them.
        assert fleet.redis is not None
        await asyncio.to_thread(fleet.redis.stop)
        w0 = fleet.workers["w0"]
        await wait_until(  # both noticed: each logged its warning
            lambda: "registry unreachable" in router.output() and "Redis failed" in w0.output(),
            30,
            blocking=True,
        )
        await asyncio.to_thread(fleet.redis.start)
        await wait_until(  # and both reconnected (with the password): logged too
            lambda: (
                "registry reachable" in router.output().split("registry unreachable")[-1]
                and "Redis reachable again" in w0.output()
            ),
            30,
            blocking=True,
        )
    finally:
        await asyncio.to_thread(fleet.close_processes)
    logs = {c.name: c.output() for c in [*fleet.workers.values(), fleet.router]}  # type: ignore[list-item]
    fleet.close()
    assert "registry unreachable" in logs["router"] or "Redis" in logs["w0"]  # logs were written
    for name, text in logs.items():
        for secret in (SECRET_PROMPT, "SECRET"):
            assert secret not in text, f"{secret!r} in {name}'s log:\n{text[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_malformed_header_line_does_not_put_a_key_in_the_log() -> None:
    import socket

    fleet = Cluster(redis=False)
    try:
        worker = fleet.start_worker("w0", WorkerSpec(decode_ms=0.0))
        router = fleet.start_router({}, worker_urls=(worker.url,), want_workers=1)
        for url in (router.url, worker.url):
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 5) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                          b"Authorization: Bearer " + SECRET_KEY.encode() + b"\x01\r\n\r\n{}")  # fmt: skip
                assert s.recv(200).startswith(b"HTTP/1.")  # answered 400, not crashed
        fleet.close_processes()
        for child in (router, worker):
            assert SECRET_KEY not in child.output(), child.output()[-1500:]
    finally:
        fleet.close()
