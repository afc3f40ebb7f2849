"""The chart's built-in Redis ACL users (the routers', one per worker pod) on a real
Redis-protocol server: a real worker (its password from a file, as the chart's init container
leaves it) and a real router (replica sync and the shared rate limit on) work with their
users, and each is refused what it must not do: a worker pod cannot touch another's record."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

import pytest
import redis

from loadtests.fleet import Child, wait_health
from loadtests.traffic import prompt
from shared.procs import free_port, http_json, wait_until
from shared.redis_server import RedisServer
from tests.helm.chart import render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ADMIN, ROUTER_PW = "admin-pw-1", "router-pw-2"
POD0, POD1 = "rr-radix-router-worker-qwen-0", "rr-radix-router-worker-qwen-1"  # the defaults' pods
PASSWORDS = {"radix-router": ROUTER_PW, f"radix-worker-{POD0}": "w0-pw-3", f"radix-worker-{POD1}": "w1-pw-4"}  # fmt: skip
_USER = re.compile(r"\s*user (radix-[-\w]+) on >(?:\$\{\w+\}|\$\(cat [^)]*\)) (.*)$")


def chart_acl_rules() -> dict[str, list[str]]:
    """user -> ACL SETUSER arguments, from the built-in Redis's start script."""
    redis_pod = render().get("Deployment", "rr-radix-router-redis")["spec"]["template"]["spec"]
    script = redis_pod["containers"][0]["args"][0]
    rules = {}
    for line in script.splitlines():
        if found := _USER.match(line):
            rules[found.group(1)] = shlex.split(found.group(2))
    assert set(rules) == set(PASSWORDS), script
    return rules


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    with RedisServer(password=ADMIN) as server:
        admin = redis.Redis(port=server.port, password=ADMIN)
        for user, rules in chart_acl_rules().items():
            admin.execute_command("ACL", "SETUSER", user, "on", f">{PASSWORDS[user]}", *rules)
        admin.close()
        yield server


def _url(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_services_run_with_their_role_users(acl_redis: RedisServer, tmp_path) -> None:
    # As in the pod: the URL names the pod's user, the password is in a file of its own.
    worker_url = f"redis://radix-worker-{POD0}@127.0.0.1:{acl_redis.port}/0"
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORDS[f"radix-worker-{POD0}"])
    router_url = _url(acl_redis, "radix-router", ROUTER_PW)
    wport, rport = free_port(), free_port()
    env = {"RADIX_WORKER_REDIS_PASSWORD_FILE": str(password_file)}
    worker = Child("w0", ["worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(wport),
                          "--worker-id", POD0, "--heartbeat-interval", "0.2", "--redis-url", worker_url],
                   f"http://127.0.0.1:{wport}", tmp_path / "w0.log", env).start()  # fmt: skip
    env = {"RADIX_ROUTER_SYNC": "true", "RADIX_ROUTER_RATE_LIMIT_PER_KEY": "1", "RADIX_ROUTER_RATE_LIMIT_BURST": "100",
           "RADIX_ROUTER_DISCOVERY_INTERVAL": "0.2"}  # fmt: skip
    router = Child("router", ["router", "serve", "--host", "127.0.0.1", "--port", str(rport), "--redis-url",
                              router_url], f"http://127.0.0.1:{rport}", tmp_path / "router.log", env).start()  # fmt: skip
    try:
        wait_health(worker)
        wait_until(
            lambda: http_json(router.url + "/readiness")[0] == 200 if router.alive else False,
            30,
            router,
        )
        for i in range(5):
            status, body = http_json(router.url + "/v1/completions", "POST", prompt(i, tokens=2))
            assert status == 200, body
        # Sync and the shared limiter wrote their keys; nothing fell back or was refused.
        admin = redis.Redis(port=acl_redis.port, password=ADMIN)
        keys = {k.decode() for k in admin.keys("radixrouter:*")}
        assert f"radixrouter:worker:{POD0}" in keys and "radixrouter:decisions" in keys
        assert any(k.startswith("radixrouter:ratelimit:") for k in keys), (keys, router.tail())
        admin.close()
        for child in (worker, router):
            assert "NOPERM" not in child.output() and "falling back" not in child.output(), (
                child.tail()
            )
        assert "Redis unavailable" not in router.output()
    finally:
        router.stop(grace_s=5)
        worker.stop(grace_s=5)
    admin = redis.Redis(port=acl_redis.port, password=ADMIN)
    assert admin.exists(f"radixrouter:worker:{POD0}") == 0  # the worker left on SIGTERM
    admin.close()


def test_each_role_is_refused_what_it_must_not_do(acl_redis: RedisServer) -> None:
    user0 = f"radix-worker-{POD0}"
    worker = redis.Redis(port=acl_redis.port, username=user0, password=PASSWORDS[user0])
    router = redis.Redis(port=acl_redis.port, username="radix-router", password=ROUTER_PW)
    own, other = f"radixrouter:worker:{POD0}", f"radixrouter:worker:{POD1}"
    worker.hset(own, "url", "http://127.0.0.1:1")  # its own record: fine
    admin = redis.Redis(port=acl_redis.port, password=ADMIN)
    admin.hset(other, "url", "http://10.0.0.2:8001")
    refused = [
        lambda: worker.hset(other, "url", "http://evil:1"),  # another worker's record
        lambda: worker.pexpire(other, 1),
        lambda: worker.delete(other),
        lambda: worker.hset("radixrouter:worker:new-pod", "url", "http://evil:1"),  # a new id
        lambda: worker.xadd("radixrouter:decisions", {"w": "x"}),  # the routers' sync stream
        lambda: worker.set("radixrouter:ratelimit:ab", 1),  # rate-limit cells
        lambda: worker.hset("radixrouter:router:r1", "w0", 1000000),  # replica load
        lambda: worker.hgetall(own),  # no reads at all
        lambda: worker.set("other:key", 1),  # outside the prefix
        lambda: worker.flushall(),
        lambda: router.hset(own, "url", "http://evil:1"),  # forge a worker
        lambda: router.delete(own),
        lambda: router.set("other:key", 1),
        lambda: router.flushall(),
        lambda: router.config_get("*"),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"call {i} was allowed")
    assert router.hgetall(own)  # routers read worker records
    assert admin.hgetall(other) == {b"url": b"http://10.0.0.2:8001"}  # untouched
    worker.close()
    router.close()
    admin.close()


def test_a_worker_pod_heartbeats_only_as_itself(acl_redis: RedisServer) -> None:
    """The registry's own writes (shared/registry.py) with pod 0's user: as pod 0 they
    go through, as pod 1 the whole transaction is refused and nothing is written."""
    import asyncio

    from redis.asyncio import Redis

    from shared.registry import Registry, WorkerRecord

    async def main() -> None:
        user0 = f"radix-worker-{POD0}"
        client = Redis(port=acl_redis.port, username=user0, password=PASSWORDS[user0])
        registry = Registry(client)
        record = WorkerRecord(POD0, "http://10.0.0.1:8001", "m", "sim", 1.0)
        await registry.publish_heartbeat(record, 3.0, joined=True)
        forged = WorkerRecord(POD1, "http://10.0.0.9:8001", "m", "sim", 1.0)
        with pytest.raises(redis.exceptions.RedisError, match=r"No permissions"):
            await registry.publish_heartbeat(forged, 3.0, joined=True)
        with pytest.raises(redis.exceptions.RedisError, match=r"No permissions"):
            await registry.leave(forged)
        await client.aclose()
        admin = Redis(port=acl_redis.port, password=ADMIN)
        assert await admin.smembers("radixrouter:workers") == {POD0.encode()}
        assert (await admin.hgetall(f"radixrouter:worker:{POD0}"))[
            b"url"
        ] == b"http://10.0.0.1:8001"
        assert not await admin.exists(f"radixrouter:worker:{POD1}")
        await admin.aclose()

    asyncio.run(main())


def test_the_chart_readme_documents_the_same_rules() -> None:
    from tests.helm.chart import CHART_DIR

    readme = (CHART_DIR / "README.md").read_text()
    for user, rules in chart_acl_rules().items():
        # The README writes POD for the pod name.
        pod = user.removeprefix("radix-worker-") if user != "radix-router" else "POD"
        generic = "radix-worker-POD" if user != "radix-router" else user
        line = next(ln for ln in readme.splitlines() if ln.startswith(f"ACL SETUSER {generic} "))
        assert [arg.replace(":POD", f":{pod}") for arg in shlex.split(line)[5:]] == rules, user
