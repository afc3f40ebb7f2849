"""Fixtures for router tests: fake upstreams and a router app over loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.holdings.sync import ReplicaSync
from router.http.app import create_app
from router.http.edge import install_hot_paths
from router.http.state import EDGE
from shared.config import RouterConfig
from tests.router.fakes import FakeWorker
from tests.router.raw_upstream import RawUpstream

StartWorkers = Callable[..., Awaitable[list[tuple[FakeWorker, TestServer]]]]
StartRouter = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def fake_workers() -> AsyncIterator[StartWorkers]:
    servers: list[TestServer] = []

    async def start(*modes: str, **kw: Any) -> list[tuple[FakeWorker, TestServer]]:
        out = []
        for i, mode in enumerate(modes):
            worker = FakeWorker(f"w{i}", mode, **kw)
            server = TestServer(worker.app(), host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            out.append((worker, server))
        return out

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    clients: list[TestClient] = []

    async def start(
        urls: list[str] | tuple[str, ...] = (),
        sync: ReplicaSync | None = None,
        clock: Callable[[], float] = time.monotonic,
        hot_paths: bool = True,
        **overrides: Any,
    ) -> TestClient:
        config = RouterConfig(worker_urls=tuple(urls), host="127.0.0.1", **overrides)
        app = create_app(config, sync=sync, clock=clock)
        server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
        client = TestClient(server)
        await client.start_server()
        if hot_paths:  # as `serve()` runs it (router/http/edge.py); False: the app's router only
            assert server.runner is not None
            install_hot_paths(server.runner, app[EDGE])
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def raw_upstreams() -> AsyncIterator[Callable[[RawUpstream], Awaitable[RawUpstream]]]:
    """Start scripted raw TCP workers (tests/router/raw_upstream.py); closed after the test."""
    started: list[RawUpstream] = []

    async def start(upstream: RawUpstream) -> RawUpstream:
        await upstream.start()
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        upstream.close()


def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")
