"""A deliberately malicious (or broken) worker behind a real router: a real aiohttp
server on loopback that answers with redirects to a "metadata" server, hostile headers,
HTML, a huge body, busy signals, or 500 to a poison prompt, next to well-behaved
workers. Each case is a finding of issue 15 and failed on the code before the fix."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.http.state import FLEET
from shared.config import RouterConfig
from tests.fuzz.conftest import start_router
from tests.waiting import wait_until

BODY = {"prompt": "hello", "max_tokens": 2}
POISON = "POISON-PILL"


@dataclass
class Evil:
    """One upstream; `mode` picks its behaviour, `hits` counts requests per path."""

    mode: str
    target: str = ""  # where redirects point
    hits: dict[str, int] = field(default_factory=dict)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    sent: int = 0  # bytes of a huge body actually written
    done: bool = False  # the huge body ended (written whole, or the peer hung up)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        self.headers_seen.append({k.lower(): v for k, v in request.headers.items()})
        raw = await request.read()
        if self.mode == "metadata":
            return web.json_response({"secret": "instance-credentials"})
        if self.mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.target + "/latest/meta-data")
        if self.mode == "html":
            return web.Response(text="<script>alert(1)</script>", content_type="text/html")
        if self.mode == "hostile_headers":
            return web.json_response(_answer("evil"), headers={
                "Access-Control-Allow-Origin": "*", "Access-Control-Allow-Credentials": "true",
                "WWW-Authenticate": "Basic realm=x", "Refresh": "0; url=http://evil",
                "Strict-Transport-Security": "max-age=31536000", "Set-Cookie": "a=b",
            })  # fmt: skip
        if self.mode == "huge":
            return await self._huge(request)
        if self.mode == "busy":
            return web.json_response(
                {"error": {"message": "full", "type": "server_error", "code": "overloaded"}},
                status=503, headers={"Retry-After": "7"},
            )  # fmt: skip
        if self.mode == "always500" or (self.mode == "poison500" and POISON.encode() in raw):
            return web.json_response({"error": {"message": "tokenizer blew up"}}, status=500)
        return web.json_response(_answer(self.mode))

    async def _huge(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b" " * 65536
        try:
            for _ in range(50 * 16):  # 50 MB unless the router stops reading
                await resp.write(chunk)
                self.sent += len(chunk)
        except ConnectionError:
            pass
        finally:
            self.done = True
        return resp


def _answer(name: str) -> dict[str, Any]:
    return {"id": "x", "object": "text_completion", "worker": name,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}  # fmt: skip


Start = Callable[..., Awaitable[str]]


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[..., Awaitable[tuple[Evil, str]]]]:
    servers: list[TestServer] = []

    async def start(mode: str, target: str = "") -> tuple[Evil, str]:
        evil = Evil(mode, target)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", evil.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return evil, str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[TestServer]]]:
    servers: list[TestServer] = []

    async def start(urls: list[str], **kw: Any) -> TestServer:
        config = RouterConfig(host="127.0.0.1", worker_urls=tuple(urls), retry_backoff=0.0,
                              policy="round_robin", **kw)  # fmt: skip
        server = await start_router(config)
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close()


async def post(server: TestServer, body: Any = BODY, **kw: Any) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.make_url("/v1/completions"), json=body, **kw) as r,
    ):
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


def breakers(server: TestServer) -> dict[str, str]:
    now = asyncio.get_running_loop().time()
    return {wid: w.breaker.state(now) for wid, w in server.app[FLEET].workers.items()}


async def test_redirects_are_not_followed(upstreams: Any, router: Any) -> None:
    """Was: a 307 to a metadata-style address made the router POST the client's body and
    headers there and return the answer with a 200."""
    metadata, meta_url = await upstreams("metadata")
    _evil, evil_url = await upstreams("redirect", meta_url)
    server = await router([evil_url], max_retries=1)
    status, body, _ = await post(server, headers={"Metadata-Flavor": "Google"})
    assert status == 502 and "instance-credentials" not in json.dumps(body)
    assert metadata.hits == {}


async def test_client_headers_reach_workers_only_from_the_allow_list(
    upstreams: Any, router: Any
) -> None:
    good, url = await upstreams("ok")
    server = await router([url])
    headers = {"Metadata-Flavor": "Google", "Cookie": "c=1", "X-Forwarded-Host": "evil",
               "Content-Encoding": "identity", "X-Request-Id": "r-1"}  # fmt: skip
    assert (await post(server, headers=headers))[0] == 200
    seen = good.headers_seen[-1]
    assert {"metadata-flavor", "cookie", "x-forwarded-host", "content-encoding"}.isdisjoint(seen)
    assert seen["content-type"] == "application/json"


async def test_hostile_response_headers_and_html_do_not_reach_clients(
    upstreams: Any, router: Any
) -> None:
    """Was: any header a worker set reached the client, and text/html passed as a 200."""
    _h, hostile = await upstreams("hostile_headers")
    _x, html = await upstreams("html")
    server = await router([hostile])
    status, _, headers = await post(server)
    assert status == 200
    got = {k.lower() for k in headers}
    assert got.isdisjoint({"access-control-allow-origin", "access-control-allow-credentials",
                           "www-authenticate", "refresh", "strict-transport-security", "set-cookie"})  # fmt: skip
    server = await router([html], max_retries=0)
    status, body, headers = await post(server)
    assert status == 502 and headers["Content-Type"].startswith("application/json")
    assert "<script>" not in json.dumps(body)


async def test_oversized_answer_is_refused_not_buffered(upstreams: Any, router: Any) -> None:
    """Was: a 300 MB body was buffered whole (router RSS 59 → 432 MB)."""
    huge, url = await upstreams("huge")
    server = await router([url], max_response_bytes=1_000_000, max_retries=0)
    status, body, _ = await post(server)
    assert status == 502 and "max_response_bytes" in body["error"]["message"]
    await wait_until(lambda: huge.done)  # the router hung up: the worker's write failed
    assert huge.sent < 10_000_000, huge.sent  # long before the body ended


async def test_busy_workers_are_retried_without_breaker_and_told_with_retry_after(
    upstreams: Any, router: Any
) -> None:
    """Was: a worker's 503 "overloaded" became a router 502 without Retry-After and
    counted as a breaker failure."""
    _b, busy = await upstreams("busy")
    _g, good = await upstreams("ok")
    server = await router([busy, good], breaker_failures=1, max_retries=1)
    for _ in range(6):
        status, body, _ = await post(server)
        assert status == 200 and body["worker"] == "ok"
    assert set(breakers(server).values()) == {"closed"}
    only_busy = await router([busy], breaker_failures=1, max_retries=2)
    for _ in range(3):
        status, body, headers = await post(only_busy)
        assert status == 503 and body["error"]["code"] == "overloaded"
        assert headers["Retry-After"] == "7"
    assert set(breakers(only_busy).values()) == {"closed"}


async def test_a_500_on_one_worker_only_is_that_workers_failure(
    upstreams: Any, router: Any
) -> None:
    _b, broken = await upstreams("always500")
    _g, good = await upstreams("ok")
    server = await router([broken, good], breaker_failures=3, max_retries=1)
    for _ in range(6):
        status, body, _ = await post(server)
        assert status == 200 and body["worker"] == "ok"
    states = breakers(server)
    assert states[broken.removeprefix("http://")] == "open"
    assert states[good.removeprefix("http://")] == "closed"


async def test_100_poison_requests_leave_every_breaker_closed_and_others_unharmed(
    upstreams: Any, router: Any
) -> None:
    """Was: every worker 5xx counted toward its breaker and was retried on every worker,
    so three poison requests opened every breaker: /health 503, all clients 503."""
    workers = [await upstreams("poison500") for _ in range(3)]
    server = await router([url for _, url in workers], breaker_failures=3, max_retries=2)
    poison = {"prompt": f"{POISON} payload", "max_tokens": 2}

    async def poisoner() -> list[int]:
        out = []
        for _ in range(100):
            status, body, _ = await post(server, poison)
            assert body["error"]["code"] == "request_failed", body
            out.append(status)
        return out

    async def client(i: int) -> list[int]:
        return [(await post(server, {"prompt": f"good {i} {j}", "max_tokens": 2}))[0]
                for j in range(20)]  # fmt: skip

    results = await asyncio.gather(poisoner(), *(client(i) for i in range(3)))
    assert results[0] == [500] * 100
    assert all(r == [200] * 20 for r in results[1:])
    assert set(breakers(server).values()) == {"closed"}
    tries = sum(evil.hits.get("/v1/completions", 0) for evil, _ in workers)
    assert tries == 100 * 2 + 60  # each poison request tried on exactly two workers
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/health")) as r:
        assert r.status == 200
