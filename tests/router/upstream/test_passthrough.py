"""The router forwards a request body untouched: fields this project's worker refuses
(`tools`, `response_format`) or does not know reach a backend that may serve them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.router.conftest import StartRouter, url_of


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[list[bytes], TestServer]]:
    bodies: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [], "usage": usage}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield bodies, server
    await server.close()


async def test_unknown_and_unsupported_fields_pass_through(
    recorder: tuple[list[bytes], TestServer], start_router: StartRouter
) -> None:
    bodies, server = recorder
    client = await start_router([url_of(server)])
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"nested": [1, 2.5, None]},  # vLLM's and SGLang's
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {"17": -5},
        "presence_penalty": 0.5,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert json.loads(bodies[-1]) == body
    # A known field out of its schema range is still refused at the edge.
    resp = await client.post("/v1/chat/completions", json={**body, "top_logprobs": 21})
    assert resp.status == 400 and len(bodies) == 1
    # A field no API documents is a typo: refused at the edge, naming it (issue 31).
    resp = await client.post("/v1/chat/completions", json={**body, "vendor_extension": 1})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "vendor_extension" and len(bodies) == 1
    assert error["message"].startswith("Unrecognized request argument supplied: vendor_extension")


async def test_a_worker_cookie_is_never_kept_nor_sent_back(start_router: StartRouter) -> None:
    """The router's upstream session keeps no cookie jar: a Set-Cookie from a worker is
    neither stored nor replayed to it with later requests (other clients' requests)."""
    cookies: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        response = web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        response.set_cookie("session", "client-a-secret")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        # A host name, not an IP: aiohttp's default jar refuses cookies from IP hosts.
        client = await start_router([f"http://localhost:{server.port}"])
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
        assert cookies == [None, None]
    finally:
        await server.close()
