"""Registry reachability as a state the router reports (issue 31): a router that cannot
read Redis keeps routing on its last known fleet and says so in `/readiness`,
`/metrics`, `/dashboard.json` and its log, naming the URL (never its password)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from router.fleet.discovery import Discovery
from router.fleet.table import Fleet
from router.policy import build_policy
from shared.config import RouterConfig
from shared.procs import Child
from shared.procs import wait_until as wait_until_sync
from shared.redis_server import RedisServer, free_port
from shared.wire.registry import redact_url
from tests.router.conftest import StartRouter, StartWorkers, url_of
from tests.waiting import ManualClock, wait_until

BODY = {"prompt": "hello registry", "max_tokens": 2}
SINCE = re.compile(r"^unreachable since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


async def test_an_outage_is_reported_everywhere_while_routing_goes_on(
    redis_server: RedisServer, fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], redis_url=redis_server.url,
                                discovery_interval=0.1)  # fmt: skip

    async def ready() -> dict[str, object]:
        r = await client.get("/readiness")
        assert r.status == 200  # the last known fleet serves: never unready for this
        return await r.json()

    async def gauge() -> str:
        text = await (await client.get("/metrics")).text()
        return re.search(r"^radix_router_registry_unreachable (\S+)$", text, re.M)[1]  # type: ignore[index]

    for _ in range(100):
        if (await ready()).get("registry") == "reachable":
            break
        await asyncio.sleep(0.05)
    assert (await ready())["registry"] == "reachable" and await gauge() == "0.0"
    redis_server.stop()
    try:
        for _ in range(200):
            if str((await ready()).get("registry")).startswith("unreachable"):
                break
            await asyncio.sleep(0.05)
        body = await ready()
        assert SINCE.match(str(body["registry"])), body
        assert await gauge() == "1.0"
        dash = (await (await client.get("/dashboard.json")).json())["registry"]
        assert SINCE.match(dash["state"]) and dash["error"] and dash["url"] == redis_server.url
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    finally:
        redis_server.start()
    for _ in range(200):
        if (await ready()).get("registry") == "reachable":
            break
        await asyncio.sleep(0.05)
    assert (await ready())["registry"] == "reachable" and await gauge() == "0.0"


async def test_an_unreachable_redis_at_start_is_named_at_once(
    start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    caplog.set_level(logging.INFO, logger="router.fleet.discovery")
    loop = asyncio.get_running_loop()
    started = loop.time()
    client = await start_router(redis_url=url)
    named = ""
    while loop.time() - started < 5.0 and not named:
        named = next((r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR), "")
        await asyncio.sleep(0.05)
    assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in named, caplog.text
    assert ":***@" in named and "hunter2" not in caplog.text
    assert "Connection" in named or "refused" in named  # the error itself
    body = await (await client.get("/readiness")).json()
    assert SINCE.match(body["registry"])


def test_serve_names_an_unreachable_redis_within_5_s(tmp_path: Path) -> None:
    """Was: `radix-router serve` with a dead Redis logged nothing about it (issue 31)."""
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    router = Child("router", ["router", "serve", "--port", "0", "--redis-url", url],
                   "", tmp_path / "router.log").start()  # fmt: skip
    try:
        # Named on the first failed read of the registry, not after some start timeout.
        wait_until_sync(lambda: "registry unreachable at" in router.output(), 5.0, router)
    finally:
        router.stop(grace_s=5)
    log = router.output()
    assert "redis://:***@127.0.0.1:" in log and "Connection refused" in log
    assert "hunter2" not in log


async def test_a_long_outage_warns_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    fleet = Fleet(RouterConfig(), build_policy(RouterConfig()))
    discovery = Discovery.from_url(
        f"redis://127.0.0.1:{free_port()}/0", "radixrouter:", fleet, interval=0.05, grace=0.0,
        clock=clock,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="router.fleet.discovery")
    task = asyncio.create_task(discovery.run())
    try:
        await wait_until(lambda: discovery.errors >= 3, timeout=10)
        said = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(said) == 1  # the first failure only, not one per retry
        clock.advance(61.0)
        errors = discovery.errors
        await wait_until(lambda: discovery.errors >= errors + 2, timeout=15)
        said = [r for r in caplog.records if "still unreachable" in r.getMessage()]
        assert len(said) == 1 and "since" in said[0].getMessage()
    finally:
        discovery.stopping = True
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
