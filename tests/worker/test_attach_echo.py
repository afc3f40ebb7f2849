"""`radix-worker attach` checks whether the stock engine echoes `x-request-id` and, where
it does not, logs the exact fix (worker/attach/echo_check.py). Real aiohttp upstreams
over loopback, one that echoes (vLLM with --enable-request-id-headers) and one that does
not (SGLang, or vLLM without it)."""

from __future__ import annotations

import json
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


def _models_engine(entries: int) -> web.Application:
    """A stock engine's `/v1/models`: the base model and `entries` LoRA adapters."""
    data = [{"id": "m"}, *({"id": f"adapter-{i:06d}", "parent": "m"} for i in range(entries))]
    body = json.dumps({"object": "list", "data": data}).encode()

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


async def _identified(entries: int) -> Upstream:
    server = TestServer(_models_engine(entries), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    config = AttachConfig(url, "vllm", "redis://unused", "w0", url)
    try:
        async with aiohttp.ClientSession() as session:
            upstream = Upstream(config, session)
            await upstream._identify()
            return upstream
    finally:
        await server.close()


async def test_the_upstreams_adapters_are_bounded_and_so_is_its_answer() -> None:
    """An attached engine listing 100 adapters is advertised with the first MAX_ADAPTERS
    (the registry's bound); one whose `/v1/models` runs past MAX_ANSWER_BYTES (here 300k
    adapters, ~12 MB) is refused as it is read, not held and parsed whole."""
    from shared.wire.registry import MAX_ADAPTERS

    upstream = await _identified(100)
    assert upstream.model == "m" and len(upstream.adapters) == MAX_ADAPTERS
    assert upstream.adapters[0] == "adapter-000000"
    with pytest.raises(ValueError, match="over"):
        await _identified(300_000)
