"""Request ids and access-log lines (shared/serving/access_log.py), on a real aiohttp app."""

from __future__ import annotations

import logging
import os

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shared.serving.access_log import make_access_middleware, request_id_of, stamp_request_id

LOG = logging.getLogger("test.access")


async def _client(enabled: bool) -> TestClient:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"echo": (await request.json())["prompt"]})

    app = web.Application(middlewares=[make_access_middleware(LOG, enabled=enabled)])
    app.on_response_prepare.append(stamp_request_id)
    app.router.add_post("/v1/completions", hello)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.mark.parametrize("enabled", [True, False])
async def test_one_line_per_request_without_the_body(
    enabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    client = await _client(enabled)
    try:
        with caplog.at_level(logging.INFO, logger="test.access"):
            r = await client.post(
                "/v1/completions",
                json={"prompt": "secret-words"},
                headers={"x-request-id": "abc-1"},
            )
            assert r.status == 200 and r.headers["x-request-id"] == "abc-1"
            r = await client.post("/v1/completions", json={"prompt": "secret-words"})
            generated = r.headers["x-request-id"]
            assert len(generated) == 32
    finally:
        await client.close()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "test.access"]
    if not enabled:
        assert lines == []
        return
    assert (
        len(lines) == 2
        and "request_id=abc-1 " in lines[0]
        and f"request_id={generated} " in lines[1]
    )
    assert all("status=200" in ln and "path=/v1/completions" in ln for ln in lines)
    assert not any("secret-words" in ln for ln in lines)


def test_untrusted_ids_are_replaced() -> None:
    assert request_id_of("ok.id:1-2_3") == "ok.id:1-2_3"
    for bad in (None, "", "a b", "x" * 129, "new\nline", "ü"):
        assert request_id_of(bad) != bad


def test_new_ids_are_unique_and_shaped_as_before() -> None:
    """A new id is 32 hex digits (as uuid4().hex was), unique in the process, and a
    forked child draws its own prefix, so ids stay unique across processes."""
    ids = [request_id_of(None) for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, request_id_of(None).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert len(child) == 32 and child[:16] != ids[0][:16]  # another prefix
