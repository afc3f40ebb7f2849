"""A worker that does not echo `x-request-id` is named, with what it costs (issue 34).

The router reuses a connection to a worker only after an answer that echoed the
request's id (router/upstream/connection.py), so a worker that does not echo costs a
new connection per request. `/workers`, `/metrics` and the dashboard say which workers
those are (router/upstream/echo.py). Two real aiohttp workers over loopback, one that
echoes and one that does not, behind a real router app, on both upstream clients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.upstream.echo import EchoBook
from tests.router.conftest import StartRouter, url_of

BODY = {"prompt": "a prompt long enough to route on " * 10, "max_tokens": 2}
ANSWER = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}


def _worker(echo: bool) -> web.Application:
    async def complete(request: web.Request) -> web.Response:
        await request.read()
        headers = {"x-request-id": request.headers["x-request-id"]} if echo else None
        return web.json_response(ANSWER, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return app


@pytest.fixture
async def workers() -> AsyncIterator[Callable[[bool], Awaitable[str]]]:
    servers: list[TestServer] = []

    async def start(echo: bool) -> str:
        server = TestServer(_worker(echo), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return url_of(server)

    yield start
    for server in servers:
        await server.close()


def _metric(text: str, name: str, worker: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f'{name}{{worker="{worker}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("client", ["own", "aiohttp"])
async def test_workers_metrics_and_dashboard_name_the_worker_without_echo(
    workers: Callable[[bool], Awaitable[str]], start_router: StartRouter, client: str
) -> None:
    echoing, silent = await workers(True), await workers(False)
    router = await start_router([echoing, silent], upstream_client=client, policy="round_robin")
    listed = (await (await router.get("/workers")).json())["data"]
    ids = {w["url"]: w["worker_id"] for w in listed}
    assert all(w["request_id_echo"] is None for w in listed)  # no answer yet
    for _ in range(6):  # round robin: three each
        r = await router.post("/v1/completions", json=BODY)
        assert r.status == 200
    listed = (await (await router.get("/workers")).json())["data"]
    echo = {w["url"]: w["request_id_echo"] for w in listed}
    for url in (echoing, silent):
        assert echo[url] is not None and echo[url]["answers_total"] >= 1, echo
    assert echo[echoing]["echoes"] is True and echo[echoing]["cost"] is None
    assert echo[echoing]["unechoed_answers_total"] == 0
    assert echo[silent]["echoes"] is False
    assert echo[silent]["unechoed_answers_total"] == echo[silent]["answers_total"]
    assert "new upstream connection per request" in echo[silent]["cost"]
    assert "--enable-request-id-headers" in echo[silent]["cost"]
    metrics = await (await router.get("/metrics")).text()
    name = "radix_router_worker_echoes_request_id"
    assert _metric(metrics, name, ids[echoing]) == 1.0
    assert _metric(metrics, name, ids[silent]) == 0.0
    unechoed = _metric(metrics, "radix_router_worker_unechoed_answers_total", ids[silent])
    assert unechoed == echo[silent]["unechoed_answers_total"]
    rows = (await (await router.get("/dashboard.json")).json())["workers"]
    assert {r["url"]: r["request_id_echo"]["echoes"] for r in rows} == {
        echoing: True,
        silent: False,
    }
    assert "id echo" in await (await router.get("/dashboard")).text()


def test_the_book_is_bounded() -> None:
    book = EchoBook(max_workers=3)
    for i in range(10):
        book.of(f"http://w{i}:8000").record(i % 2 == 0)
    assert book.get("http://w0:8000") is None  # the oldest went first
    kept = book.get("http://w9:8000")
    assert kept is not None and kept.describe()["echoes"] is False
    assert sum(book.get(f"http://w{i}:8000") is not None for i in range(10)) == 3
