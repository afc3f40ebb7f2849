"""Shared by the security tests: keys, an in-process sim worker and router factory
(their own `create_app` factories on loopback), and small request helpers. Fixtures are
registered under short names (`router`, `worker_url`, `http`) by importing them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from shared.config import RouterConfig
from tests.fuzz.conftest import start_router, start_worker, worker_config

CLIENT_KEY, ADMIN_KEY = "sk-client-7f3a9c", "sk-admin-51d2e8"
BEARER = {"Authorization": f"Bearer {CLIENT_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"prompt": "hello", "max_tokens": 2}

StartRouter = Callable[..., Awaitable[str]]


@pytest.fixture(name="worker_url")
async def worker_url_fixture() -> AsyncIterator[str]:
    server = await start_worker(worker_config(sim_decode_ms_per_token=25.0))
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture(name="router")
async def router_fixture() -> AsyncIterator[StartRouter]:
    servers: list[TestServer] = []

    async def start(**kw: Any) -> str:
        server = await start_router(RouterConfig(host="127.0.0.1", retry_backoff=0.0, **kw))
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for s in servers:
        await s.close()


@pytest.fixture(name="http")
async def http_fixture() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def request(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, Any]:  # fmt: skip
    async with http.request(method, url, json=body, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


def assert_error(status: int, body: Any, want: int, kind: str) -> None:
    assert status == want, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind
