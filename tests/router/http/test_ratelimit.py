"""Per-key rate limit: a token bucket per client, exact under an injected clock."""

from __future__ import annotations

import asyncio

from aiohttp import web
from redis.asyncio import Redis

from router.http.ratelimit import (
    REDIS_RETRY_S,
    ClientIdentity,
    TokenBuckets,
    make_rate_limit_check,
)
from shared.config import RouterConfig
from tests.router.conftest import StartRouter, StartWorkers, url_of

BODY = {"prompt": "hello", "max_tokens": 2}


def test_bucket_allows_a_burst_then_the_rate() -> None:
    now = [100.0]
    buckets = TokenBuckets(rate=2.0, burst=3, clock=lambda: now[0])
    assert [buckets.take(b"a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take(b"a") == 0.5  # empty: one token comes back in 1 / rate s
    assert buckets.take(b"b") == 0.0  # another client has its own bucket
    now[0] += 0.5
    assert buckets.take(b"a") == 0.0
    assert buckets.take(b"a") > 0
    now[0] += 60
    assert [buckets.take(b"a") for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # refill capped


async def test_router_answers_429_per_key(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("ok")
    client = await start_router(
        [url_of(server)], api_keys=("k1", "k2"), rate_limit_per_key=0.01, rate_limit_burst=2
    )
    k1 = {"Authorization": "Bearer k1"}
    assert [
        (await client.post("/v1/completions", json=BODY, headers=k1)).status for _ in range(2)
    ] == [200, 200]
    r = await client.post("/v1/completions", json=BODY, headers=k1)
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
    # Other clients and non-inference endpoints are not limited by k1's use.
    k2 = {"Authorization": "Bearer k2"}
    assert (await client.post("/v1/completions", json=BODY, headers=k2)).status == 200
    assert (await client.get("/v1/models", headers=k1)).status == 200


def _request(remote: str, headers: dict[str, str]) -> web.Request:
    from aiohttp.test_utils import make_mocked_request

    class _Transport:
        def get_extra_info(self, name: str, default: object = None) -> object:
            return (remote, 1234) if name == "peername" else default

    return make_mocked_request("POST", "/v1/completions", headers=headers, transport=_Transport())


def test_without_api_keys_clients_are_their_address_not_their_bearer() -> None:
    who = ClientIdentity(RouterConfig())
    a = who(_request("10.0.0.1", {"Authorization": "Bearer random-1"}))
    assert a == who(_request("10.0.0.1", {"Authorization": "Bearer random-2"}))
    assert a != who(_request("10.0.0.2", {}))


def test_forwarded_for_counts_only_behind_a_trusted_proxy() -> None:
    who = ClientIdentity(RouterConfig(trusted_proxies=("10.0.0.0/8",)))
    xff = {"X-Forwarded-For": "203.0.113.7, 10.1.1.1"}
    assert who.address(_request("10.2.2.2", xff)) == "203.0.113.7"  # LB, then an inner proxy
    assert who.address(_request("198.51.100.9", xff)) == "198.51.100.9"  # untrusted peer: ignored
    spoof = {"X-Forwarded-For": "1.2.3.4, 203.0.113.7"}  # the client prepends a lie
    assert who.address(_request("10.2.2.2", spoof)) == "203.0.113.7"


def test_with_api_keys_clients_are_their_key() -> None:
    who = ClientIdentity(RouterConfig(api_keys=("k1", "k2")))
    same_ip = [_request("10.0.0.1", {"Authorization": f"Bearer {k}"}) for k in ("k1", "k2")]
    assert who(same_ip[0]) != who(same_ip[1])


async def test_a_silent_redis_is_asked_again_only_after_the_retry_interval() -> None:
    """Redis accepts connections but never answers: the first request waits out
    `rate_limit_redis_timeout` and falls back to the local bucket; the next ones go
    straight to the local bucket until `REDIS_RETRY_S` has passed on the router's clock."""
    commands = 0  # reads of what a client sent (the handshake, then the script)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal commands
        while await reader.read(65536):
            commands += 1
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    redis = Redis.from_url(f"redis://127.0.0.1:{port}", socket_timeout=0.05)
    now = [1000.0]
    config = RouterConfig(rate_limit_per_key=1000.0, rate_limit_burst=100)
    check = make_rate_limit_check(config, lambda: now[0], redis)
    assert check is not None

    async def send() -> int:
        await check(_request("10.0.0.1", {}))  # raises the 429 when refused
        return 200

    try:
        assert await send() == 200  # Redis timed out: the local bucket admitted it
        asked = commands
        assert asked >= 1
        for _ in range(20):
            assert await send() == 200
        assert commands == asked  # no request waited on Redis again
        now[0] += REDIS_RETRY_S
        assert await send() == 200
        assert commands > asked  # retry interval over: Redis asked again
    finally:
        await redis.aclose()
        server.close()
        await server.wait_closed()


async def test_refusals_are_counted_by_their_error_code(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], rate_limit_per_key=0.01, rate_limit_burst=1)
    assert [(await client.post("/v1/completions", json=BODY)).status for _ in range(3)] == [
        200, 429, 429,
    ]  # fmt: skip
    metrics = await (await client.get("/metrics")).text()
    assert 'radix_router_rejected_total{reason="rate_limit_exceeded"} 2.0' in metrics
    assert 'radix_router_worker_requests_total{status="200",worker="' in metrics
