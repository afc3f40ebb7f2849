"""A `prompt_cache_key` is the caller's: two tenants that pick the same key are two
sessions (router/holdings/sessions.py keys its table by tenant and key). The worker pins
by the key it is told, so the router tells it the tenant's key (PIN_KEY_HEADER), not the
client's text: one tenant's call must not release another's pin, and a moved session's
release (POST /release_pin) must release its own pin only. A real router app and a real
sim worker over loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.worker.conftest import WorkerThread, sim_config

TENANTS = {"a": {"keys": ["key-a"]}, "b": {"keys": ["key-b"]}}


@pytest.fixture
def worker() -> Iterator[WorkerThread]:
    config = sim_config(pin_max_ttl_s=100.0, pin_default_ttl_s=60.0)
    with WorkerThread(config) as w:
        yield w


async def _call(client: TestClient, api_key: str, text: str, key: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "prompt_cache_key": key}  # fmt: skip
    r = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
    )
    assert r.status == 200, await r.text()
    return await r.json()


async def _pins(client: TestClient, worker: WorkerThread) -> int:
    async with client.session.get(worker.url + "/get_server_info") as r:
        info = await r.json()
        assert r.status == 200, info
        return info["stats"]["pins"]


async def test_two_tenants_with_one_key_keep_two_pins(
    worker: WorkerThread, start_router: Any
) -> None:
    client = await start_router([worker.url], tenants=TENANTS, api_keys=("key-a", "key-b"))
    first = await _call(client, "key-a", "tenant a's context " * 20, "session-1")
    assert first["usage"]["cache_pin"]["ttl_s"] == 60.0
    assert await _pins(client, worker) == 1
    await _call(client, "key-b", "tenant b's context " * 20, "session-1")
    assert await _pins(client, worker) == 2  # b's call released nothing of a's
    await _call(client, "key-a", "tenant a's context " * 20 + "next", "session-1")
    assert await _pins(client, worker) == 2  # a's next call replaced a's own pin


async def test_a_moved_sessions_release_names_its_tenants_pin(
    worker: WorkerThread, start_router: Any
) -> None:
    """What the router sends when a session moves (proxy.py `_release_pin`): the client's
    key in the body, the tenant's session in PIN_KEY_HEADER. It releases that tenant's
    pin only; the client's text alone names no pin the router made."""
    from router.holdings.sessions import session_digest
    from shared.wire.protocol import PIN_KEY_HEADER

    client = await start_router([worker.url], tenants=TENANTS, api_keys=("key-a", "key-b"))
    await _call(client, "key-a", "tenant a's context " * 20, "session-1")
    await _call(client, "key-b", "tenant b's context " * 20, "session-1")
    assert await _pins(client, worker) == 2

    async def release(header: str | None) -> tuple[int, Any]:
        headers = {PIN_KEY_HEADER: header} if header is not None else {}
        async with client.session.post(
            worker.url + "/release_pin", json={"prompt_cache_key": "session-1"}, headers=headers
        ) as r:
            return r.status, await r.json()

    assert await release(None) == (200, {"released": False})
    a_session = session_digest("tenant:a", "session-1").hex()
    assert await release(a_session) == (200, {"released": True})
    assert await _pins(client, worker) == 1  # b's pin stays
    status, answer = await release("x" * 2000)
    assert status == 400 and PIN_KEY_HEADER in answer["error"]["message"]
