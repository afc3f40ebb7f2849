"""Both services in-process on loopback, built through their own `create_app` factories:
a sim worker (the real app and engine, cost model instead of weights) and a router whose
only worker is that one (a static URL, no Redis). Small body limits make 413 cheap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp.test_utils import TestServer

from router.http.app import create_app as create_router
from shared.config import RouterConfig, WorkerConfig
from tests.router.conftest import ServedTestServer
from worker.backends import build_engine
from worker.http.app import create_app as create_worker
from worker.http.state import STATE

BODY_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Services:
    worker: str  # base URLs
    router: str


def worker_config(**kw: object) -> WorkerConfig:
    base = {"engine": "sim", "host": "127.0.0.1", "port": 0, "cache_tokens": 20_000,
            "max_model_len": 4096, "max_body_bytes": BODY_LIMIT}  # fmt: skip
    return WorkerConfig.model_validate({**base, **kw})


async def start_worker(config: WorkerConfig) -> TestServer:
    app = create_worker(config, build_engine(config))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await app[STATE].ready.wait()
    return server


async def start_router(config: RouterConfig) -> TestServer:
    """The router as `serve()` serves it (tests/router/conftest.py `ServedTestServer`)."""
    server = ServedTestServer(create_router(config), host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    worker = await start_worker(worker_config())
    worker_url = str(worker.make_url("")).rstrip("/")
    router = await start_router(
        RouterConfig(host="127.0.0.1", worker_urls=(worker_url,), max_body_bytes=BODY_LIMIT)
    )
    yield Services(worker_url, str(router.make_url("")).rstrip("/"))
    await router.close()
    await worker.close()
