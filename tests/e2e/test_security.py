"""Security of the router's edge: keys, the admin API, header hygiene, admission limits,
and what reaches the logs. The router and a sim worker run in-process (their own
`create_app` factories on loopback); the log test runs real processes and reads their
stderr. Header tests use a raw-socket upstream that records exactly what arrived and
answers with exactly the headers it is told to."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.e2e.edge import (
    ADMIN,
    ADMIN_KEY,
    BEARER,
    BODY,
    CLIENT_KEY,
    StartRouter,
    assert_error,
    http_fixture,
    request,
    router_fixture,
    worker_url_fixture,
)

FIXTURES = (http_fixture, router_fixture, worker_url_fixture)  # registered by import


async def test_client_keys_are_enforced(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession
) -> None:
    base = await router(worker_urls=(worker_url,), api_keys=(CLIENT_KEY,), admin_key=ADMIN_KEY)
    url = base + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": CLIENT_KEY},
                    {"Authorization": f"Basic {CLIENT_KEY}"}):  # fmt: skip
        status, body, h = await request(http, "POST", url, BODY, headers)
        assert_error(status, body, 401, "authentication_error")
        assert h.get("WWW-Authenticate") == "Bearer"
        assert CLIENT_KEY not in json.dumps(body)
    assert (await request(http, "POST", url, BODY, BEARER))[0] == 200
    assert (await request(http, "POST", url, BODY, ADMIN))[0] == 200  # the admin key may use it
    # The official client: a wrong key is its AuthenticationError, the right one works.
    bad = openai.AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="sim", prompt="hi", max_tokens=2)
    good = openai.AsyncOpenAI(base_url=base + "/v1", api_key=CLIENT_KEY, max_retries=0)
    done = await good.completions.create(model="sim", prompt="hi", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens == 2
    await bad.close()
    await good.close()


async def test_admin_key_is_separate_from_client_keys(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession
) -> None:
    base = await router(api_keys=(CLIENT_KEY,), admin_key=ADMIN_KEY)
    add = {"url": worker_url, "worker_id": "w-admin"}
    for headers in ({}, BEARER):  # a client key cannot change the fleet
        status, body, _ = await request(http, "POST", base + "/workers", add, headers)
        assert_error(status, body, 401, "authentication_error")
        status, body, _ = await request(http, "DELETE", base + "/workers/x", None, headers)
        assert_error(status, body, 401, "authentication_error")
    status, body, _ = await request(http, "POST", base + "/workers", add, ADMIN)
    assert status == 201 and body["worker_id"] == "w-admin"
    assert (await request(http, "POST", base + "/v1/completions", BODY, BEARER))[0] == 200
    assert (await request(http, "DELETE", base + "/workers/w-admin", None, ADMIN))[0] == 200
    # Without an admin key configured, the admin API is off for everyone.
    closed = await router(api_keys=(CLIENT_KEY,))
    status, body, _ = await request(http, "POST", closed + "/workers", add, BEARER)
    assert_error(status, body, 403, "permission_error")


@pytest.mark.parametrize("protect", [False, True])
async def test_metrics_and_health_open_or_protected_by_option(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession, protect: bool
) -> None:
    base = await router(worker_urls=(worker_url,), api_keys=(CLIENT_KEY,), protect_metrics=protect)
    for path in ("/metrics", "/health"):
        status, body, _ = await request(http, "GET", base + path)
        if protect:
            assert_error(status, body, 401, "authentication_error")
            assert (await request(http, "GET", base + path, None, BEARER))[0] == 200
        else:
            assert status == 200
    assert (await request(http, "GET", base + "/openapi.json"))[0] == 200  # always public


BAD_URLS = [
    "file:///etc/passwd", "http://127.0.0.1", "http://user:pw@127.0.0.1:9000",
    "ftp://127.0.0.1:21", "http://127.0.0.1:9000/?next=x", "http://127.0.0.1:9000/#x",
    "gopher://127.0.0.1:70", "127.0.0.1:9000", "http://:9000", "", "http://127.0.0.1:99999",
]  # fmt: skip


async def test_admin_api_accepts_only_http_host_port_urls(
    router: StartRouter, worker_url: str, http: aiohttp.ClientSession
) -> None:
    base = await router(admin_key=ADMIN_KEY)
    for url in BAD_URLS:
        status, body, _ = await request(http, "POST", base + "/workers", {"url": url}, ADMIN)
        assert_error(status, body, 400, "invalid_request_error")
        assert body["error"]["param"] == "url", (url, body)
    for body_in in ({"url": 5}, {}, {"url": worker_url, "worker_id": ""}):
        status, body, _ = await request(http, "POST", base + "/workers", body_in, ADMIN)
        assert_error(status, body, 400, "invalid_request_error")
    _, listed, _ = await request(http, "GET", base + "/workers")
    assert listed["data"] == []  # nothing of the above got in
    status, _, _ = await request(http, "POST", base + "/workers", {"url": worker_url}, ADMIN)
    assert status == 201
