"""The inference routes served without the app's router (router/http/edge.py
`install_hot_paths`), and the simplest of them by the router's own protocol
(router/http/fast_server.py, `fast_hot_paths`), answer exactly as through the app's
router: status, OpenAI-shaped errors, request ids, the access-log line, the router's
counts; and only they take those ways."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from router.http.edge import install_hot_paths
from router.http.state import EDGE
from tests.router.conftest import StartRouter, StartWorkers, url_of

OK = {"model": "sim", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": True}
AUTH = {"Authorization": "Bearer k"}


async def _exchanges(client: Any) -> list[tuple[Any, ...]]:
    """What a client sees of each kind of inference request (ids fixed where sent)."""
    cases: list[tuple[str, str, Any, dict[str, str]]] = [
        ("POST", "/v1/completions", OK, {**AUTH, "x-request-id": "id-1"}),
        ("POST", "/v1/chat/completions", CHAT, {**AUTH, "x-request-id": "id-2"}),
        ("POST", "/v1/completions", OK, {"x-request-id": "id-3"}),  # no key: 401
        ("POST", "/v1/completions", b"{not json", {**AUTH, "x-request-id": "id-4"}),
        ("POST", "/v1/completions", {**OK, "stream": 1}, {**AUTH, "x-request-id": "id-5"}),
        ("POST", "/v1/completions", {"prompt": 5}, {**AUTH, "x-request-id": "id-6"}),
        ("GET", "/v1/completions", None, {**AUTH, "x-request-id": "id-7"}),  # 405
        ("POST", "/v1/completions?x=1", OK, {**AUTH, "x-request-id": "id-8"}),  # the app's way
    ]
    out = []
    for method, path, body, headers in cases:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with client.request(method, path, headers=headers, **kw) as r:
            text = await r.text()
            # The answer's own ids and times differ per run; statuses, error bodies,
            # routing headers and the echoed request id must not.
            text = re.sub(r'"(id|created)": ?("[^"]*"|\d+)', "", text)
            # The head, header by header in its order (the date aside): the own protocol
            # frames its answers itself (router/http/fast_answer.py) by aiohttp's rules.
            head = [(k, v) for k, v in r.raw_headers if k.lower() != b"date"]
            out.append(
                (path, r.status, r.headers.get("x-request-id"), r.headers.get("x-radix-worker"),
                 r.headers.get("Content-Type", "").split(";")[0], text, r.version, r.reason, head)
            )  # fmt: skip
    return out


async def _metrics(client: Any) -> list[str]:
    text = await (await client.get("/metrics", headers=AUTH)).text()
    wanted = ("radix_router_requests_total", "radix_router_worker_requests_total")
    return sorted(line for line in text.splitlines() if line.startswith(wanted))


def _through_aiohttp(client: Any) -> list[str]:
    """The requests that reach aiohttp's request handler from now on ("METHOD target"),
    recorded as they come."""
    runner = client.server.runner
    assert runner is not None and runner.server is not None
    seen: list[str] = []
    aiohttp_way = runner.server.request_handler

    async def counted(request: web.BaseRequest) -> web.StreamResponse:
        seen.append(f"{request.method} {request.raw_path}")
        return await aiohttp_way(request)

    runner.server.request_handler = counted
    return seen


async def test_the_same_answers_either_way(
    fake_workers: StartWorkers, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    [(_, server)] = await fake_workers("ok")
    seen = {}
    ways = {"fast": {"fast_hot_paths": True}, "hot": {"fast_hot_paths": False},
            "app": {"hot_paths": False}}  # fmt: skip
    for way, kw in ways.items():
        client = await start_router([url_of(server)], api_keys=("k",), **kw)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="router.access"):
            exchanges = await _exchanges(client)
        lines = [
            re.sub(r" ms=[\d.]+", "", rec.getMessage())
            for rec in caplog.records
            if rec.name == "router.access"
        ]
        seen[way] = (exchanges, lines, await _metrics(client))
    exchanges, lines, metrics = seen["fast"]
    assert [s[1] for s in exchanges] == [200, 200, 401, 400, 400, 400, 405, 200]
    assert [s[2] for s in exchanges] == [f"id-{i}" for i in range(1, 9)]
    assert (
        exchanges[0][3] == url_of(server).removeprefix("http://")
        and exchanges[1][4] == "text/event-stream"
    )
    assert len(lines) == 8 and all("request_id=id-" in line for line in lines)
    assert any('status="200"' in m for m in metrics)
    assert seen["fast"] == seen["hot"] == seen["app"]


async def test_only_the_inference_routes_skip_the_app_router(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], hot_paths=False)
    through_app = _through_aiohttp(client)  # installed below it: the hot paths go around
    install_hot_paths(client.server.runner, client.app[EDGE])
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = OK if path == "/v1/completions" else {**CHAT, "stream": False}
        assert (await client.post(path, json=body)).status == 200
    assert through_app == []
    await client.post("/v1/completions?x=1", json=OK)
    await client.post("/generate", json={"text": "hi"})
    await client.get("/v1/completions")
    headers = {"Expect": "100-continue"}
    assert (await client.post("/v1/completions", json=OK, headers=headers)).status == 200
    assert through_app == [
        "POST /v1/completions?x=1", "POST /generate", "GET /v1/completions",
        "POST /v1/completions",
    ]  # fmt: skip


async def test_only_the_simplest_inference_requests_skip_aiohttp(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    """With `fast_hot_paths`, a plain POST of an inference route never reaches aiohttp's
    server; a query, another route or method, `Expect`, a chunked body or `Connection:
    close` does (and the connection is aiohttp's from then on)."""
    [(_, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], fast_hot_paths=True)
    through_aiohttp = _through_aiohttp(client)
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = OK if path == "/v1/completions" else CHAT
        for _ in range(2):
            assert (await client.post(path, json=body)).status == 200
    assert through_aiohttp == []
    await client.post("/v1/completions?x=1", json=OK)
    await client.post("/generate", json={"text": "hi"})
    await client.get("/v1/completions")
    await client.post("/v1/completions", json=OK, headers={"Expect": "100-continue"})
    await client.post("/v1/completions", json=OK, headers={"Connection": "close"})

    async def chunks() -> AsyncIterator[bytes]:
        yield json.dumps(OK).encode()

    await client.post("/v1/completions", data=chunks())
    assert through_aiohttp == [
        "POST /v1/completions?x=1", "POST /generate", "GET /v1/completions",
        "POST /v1/completions", "POST /v1/completions", "POST /v1/completions",
    ]  # fmt: skip


async def test_the_hot_paths_ask_for_a_key_wherever_the_app_does(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    """The hot paths' guard (router/http/auth.py `hot_auth_check`) is left out only where
    no client key is configured: a tenant's keys alone make the own protocol ask for one."""
    from router.http.auth import hot_auth_check, make_auth_check
    from router.http.edge import HOT_PATHS
    from shared.config import RouterConfig

    [(_, server)] = await fake_workers("ok")
    tenants = {"a": {"keys": ["ka"]}}
    client = await start_router([url_of(server)], tenants=tenants, fast_hot_paths=True)
    through_aiohttp = _through_aiohttp(client)
    assert (await client.post("/v1/completions", json=OK)).status == 401
    headers = {"Authorization": "Bearer ka"}
    assert (await client.post("/v1/completions", json=OK, headers=headers)).status == 200
    assert through_aiohttp == []  # both answered by the own protocol
    for config in (RouterConfig(api_keys=("k",)), RouterConfig(tenants=tenants)):
        check = make_auth_check(config)
        assert hot_auth_check(config, check, HOT_PATHS) is check
    assert hot_auth_check(RouterConfig(), make_auth_check(RouterConfig()), HOT_PATHS) is None
    for path in ("/workers", "/metrics", "/liveness"):  # never left out on a guess
        with pytest.raises(ValueError):
            hot_auth_check(RouterConfig(), make_auth_check(RouterConfig()), (path,))
