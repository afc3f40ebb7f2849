"""`radix-worker attach` checks whether the stock engine echoes `x-request-id` and, where
it does not, logs the exact fix (worker/attach/echo_check.py). Real aiohttp upstreams
over loopback, one that echoes (vLLM with --enable-request-id-headers) and one that does
not (SGLang, or vLLM without it)."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from worker.attach.sidecar import AttachConfig, Upstream


def _engine(echo: bool) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        headers = {"X-Request-Id": request.headers["x-request-id"]} if echo else None
        return web.json_response({"object": "list", "data": [{"id": "m"}]}, headers=headers)

    async def server_info(request: web.Request) -> web.Response:  # SGLang's capacity
        return web.json_response({"max_total_num_tokens": 1000})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", server_info)
    return app


FIX = {"vllm": "--enable-request-id-headers", "sglang": "SGLang has no switch"}


@pytest.mark.parametrize(("engine", "echo"), [("vllm", True), ("vllm", False), ("sglang", False)])
async def test_the_echo_is_checked_and_the_fix_named(
    engine: str, echo: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server = TestServer(_engine(echo), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    config = AttachConfig(url, engine, "redis://unused", "w0", url)  # type: ignore[arg-type]
    try:
        async with aiohttp.ClientSession() as session:
            upstream = Upstream(config, session)
            with caplog.at_level(logging.WARNING, logger="worker.attach"):
                await upstream._identify()
    finally:
        await server.close()
    assert upstream.echoes is echo and upstream.model == "m"
    warned = [r.getMessage() for r in caplog.records if "does not echo" in r.getMessage()]
    assert bool(warned) is not echo
    if warned:
        assert "routers open a new connection per request" in warned[0]
        assert FIX[engine] in warned[0]
