"""Fixtures for router tests: fake upstreams and a router app over loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from router.holdings.sync import ReplicaSync
from router.http.app import create_app, serving_protocol, serving_runner
from router.http.edge import install_hot_paths
from router.http.fast_server import FastServer
from router.http.state import CONFIG, EDGE
from shared.config import RouterConfig
from shared.serving.http_server import bind
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


class ServedTestServer(TestServer):
    """aiohttp's test server, listening as `serve()` listens (router/http/app.py): the
    hot paths, the head deadline, and the router's own protocol where the config's
    `fast_hot_paths` is on."""

    fast: FastServer | None = None

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        if self.runner:
            return
        app: web.Application = self.app  # type: ignore[assignment]
        config = app[CONFIG]
        self.runner = runner = await serving_runner(app)
        self.fast = serving_protocol(runner, config)
        await bind(runner, self.host, 0, header_read_timeout=config.header_read_timeout,
                   protocol=self.fast)  # fmt: skip
        self.port = runner.addresses[0][1]
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    async def close(self) -> None:
        if self.fast is not None:  # as `serve()` stops (router/http/app.py `stop_serving`)
            self.fast.close()
        await super().close()


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
        if not hot_paths:  # the app's router for every request
            overrides["fast_hot_paths"] = False
        config = RouterConfig(worker_urls=tuple(urls), host="127.0.0.1", **overrides)
        app = create_app(config, sync=sync, clock=clock)
        if config.fast_hot_paths:  # served as `serve()` serves it, the own protocol in front
            server: TestServer = ServedTestServer(app, host="127.0.0.1")
        else:
            server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
        client = TestClient(server)
        await client.start_server()
        if hot_paths and not config.fast_hot_paths:
            # as `serve()` runs it (router/http/edge.py); False: the app's router only
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
