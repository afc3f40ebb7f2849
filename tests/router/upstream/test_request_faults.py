"""Issue 21, finding 3: a request that runs into a limit (request_timeout, or an answer
over max_response_bytes) is the request's fault, not the fleet's. Tried once more on
another worker; when that one fails the same way the client gets 504/502 naming the
limit, and no breaker is charged. Real aiohttp workers over loopback: a prompt "slow"
is answered after 5 s, "big" with a 20 KB answer, anything else at once. Run over both
upstream transports (router/upstream/transport.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.http.state import FLEET
from tests.router.conftest import StartRouter

SMALL = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}


async def _complete(request: web.Request) -> web.Response:
    prompt = (await request.json())["prompt"]
    if prompt == "slow":
        await asyncio.sleep(5)
    if prompt == "big":
        return web.json_response({**SMALL, "pad": "x" * 20000})
    return web.json_response(SMALL)


@pytest.fixture
async def workers() -> AsyncIterator[list[str]]:
    servers = []
    for _ in range(3):
        app = web.Application()
        app.router.add_post("/v1/completions", _complete)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    yield [str(s.make_url("")).rstrip("/") for s in servers]
    for server in servers:
        await server.close()


@pytest.mark.parametrize("transport", ["own", "aiohttp"])
@pytest.mark.parametrize(
    ("prompt", "status", "code"),
    [("slow", 504, "request_timeout"), ("big", 502, "response_too_large")],
    ids=["timeout", "oversized"],
)
async def test_requests_over_a_limit_open_no_breaker(
    workers: list[str], start_router: StartRouter, transport: str, prompt: str, status: int,
    code: str,
) -> None:  # fmt: skip
    # The size case keeps a roomy deadline: only the limit under test may fire (0.3 s with
    # everything on one loop timed a 20 KB answer out once on a loaded machine).
    timeout = 0.3 if prompt == "slow" else 10.0
    client = await start_router(
        workers, upstream_client=transport, request_timeout=timeout, max_response_bytes=10000,
        max_retries=2, retry_backoff=0, breaker_failures=3,
    )  # fmt: skip
    bad_statuses: list[int] = []
    good: list[int] = []

    async def bad_client() -> None:
        for _ in range(10):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            body = await r.json()
            bad_statuses.append(r.status)
            assert body["error"]["code"] == code, body
            limit = "request_timeout" if prompt == "slow" else "max_response_bytes"
            assert limit in body["error"]["message"] and "2 workers" in body["error"]["message"]

    async def good_client() -> None:
        for _ in range(40):
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            good.append(r.status)
            assert json.loads(await r.text())["choices"][0]["text"] == "ok"

    await asyncio.gather(*[bad_client() for _ in range(10)], good_client(), good_client())
    assert bad_statuses == [status] * 100
    assert good == [200] * 80  # other clients unharmed
    fleet = client.server.app[FLEET]
    now = asyncio.get_running_loop().time()
    assert {w.url: w.failures_total for w in fleet.workers.values()} == dict.fromkeys(workers, 0)
    assert {w.breaker.state(now) for w in fleet.workers.values()} == {"closed"}


async def test_a_streamed_request_that_times_out_is_still_the_workers_failure(
    workers: list[str], start_router: StartRouter
) -> None:
    """A stream's head not arriving within request_timeout: the worker's (no verdict to
    wait for: a stream's first byte is not a long answer)."""
    client = await start_router(workers[:1], request_timeout=0.3, max_retries=0)
    r = await client.post("/v1/completions", json={"prompt": "slow", "stream": True})
    assert r.status == 504
    fleet = client.server.app[FLEET]
    assert [w.failures_total for w in fleet.workers.values()] == [1]
