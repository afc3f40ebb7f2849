"""The chart's built-in Redis ACL users (one per role) on a real Redis-protocol server:
a real worker and a real router (replica sync and the shared rate limit on) work with their role's
user, and each role is refused what it must not do."""

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
ADMIN, ROUTER_PW, WORKER_PW = "admin-pw-1", "router-pw-2", "worker-pw-3"


def chart_acl_rules() -> dict[str, list[str]]:
    """user -> ACL SETUSER arguments, from the built-in Redis's start script."""
    redis_pod = render().get("Deployment", "rr-radix-router-redis")["spec"]["template"]["spec"]
    script = redis_pod["containers"][0]["args"][0]
    rules = {}
    for line in script.splitlines():
        found = re.match(r"\s*user (radix-\w+) on >\$\{\w+\} (.*)$", line)
        if found:
            rules[found.group(1)] = shlex.split(found.group(2))
    assert set(rules) == {"radix-router", "radix-worker"}, script
    return rules


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    with RedisServer(password=ADMIN) as server:
        admin = redis.Redis(port=server.port, password=ADMIN)
        for user, password in (("radix-router", ROUTER_PW), ("radix-worker", WORKER_PW)):
            admin.execute_command(
                "ACL", "SETUSER", user, "on", f">{password}", *chart_acl_rules()[user]
            )
        admin.close()
        yield server


def _url(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_services_run_with_their_role_users(acl_redis: RedisServer, tmp_path) -> None:
    worker_url, router_url = (
        _url(acl_redis, "radix-worker", WORKER_PW),
        _url(acl_redis, "radix-router", ROUTER_PW),
    )
    wport, rport = free_port(), free_port()
    worker = Child("w0", ["worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(wport),
                          "--worker-id", "w0", "--heartbeat-interval", "0.2", "--redis-url", worker_url],
                   f"http://127.0.0.1:{wport}", tmp_path / "w0.log").start()  # fmt: skip
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
        assert "radixrouter:worker:w0" in keys and "radixrouter:decisions" in keys
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
    assert admin.exists("radixrouter:worker:w0") == 0  # the worker left on SIGTERM
    admin.close()


def test_each_role_is_refused_what_it_must_not_do(acl_redis: RedisServer) -> None:
    worker = redis.Redis(port=acl_redis.port, username="radix-worker", password=WORKER_PW)
    router = redis.Redis(port=acl_redis.port, username="radix-router", password=ROUTER_PW)
    worker.hset("radixrouter:worker:w9", "url", "http://127.0.0.1:1")  # its own kind of key: fine
    refused = [
        lambda: worker.xadd("radixrouter:decisions", {"w": "x"}),  # the routers' sync stream
        lambda: worker.set("radixrouter:ratelimit:ab", 1),  # rate-limit cells
        lambda: worker.hset("radixrouter:router:r1", "w0", 1000000),  # replica load
        lambda: worker.hgetall("radixrouter:worker:w9"),  # no reads at all
        lambda: worker.set("other:key", 1),  # outside the prefix
        lambda: worker.flushall(),
        lambda: router.hset("radixrouter:worker:w9", "url", "http://evil:1"),  # forge a worker
        lambda: router.delete("radixrouter:worker:w9"),
        lambda: router.set("other:key", 1),
        lambda: router.flushall(),
        lambda: router.config_get("*"),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"call {i} was allowed")
    assert router.hgetall("radixrouter:worker:w9")  # routers read worker records
    worker.close()
    router.close()


def test_the_chart_readme_documents_the_same_rules() -> None:
    from tests.helm.chart import CHART_DIR

    readme = (CHART_DIR / "README.md").read_text()
    for user, rules in chart_acl_rules().items():
        line = next(ln for ln in readme.splitlines() if ln.startswith(f"ACL SETUSER {user} "))
        assert shlex.split(line)[5:] == rules, user
