"""The chart's built-in Redis ACL users (the routers', one per worker pod) on a real
Redis-protocol server started by the chart's own container command (its script writes the
ACL file from the Secrets' passwords): a real worker (its password from a file, as the chart's init container
leaves it) and a real router (replica sync and the shared rate limit on) work with their
users, and each is refused what it must not do: a worker pod cannot touch another's record."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from loadtests.load.cluster import Child, wait_health
from loadtests.load.traffic import prompt
from shared.procs import free_port, http_json, wait_until
from shared.redis_server import find_server_binary
from tests.e2e.test_attach import FakeSGLang, fake  # noqa: F401 (the fixture)
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


@dataclass(frozen=True)
class ChartRedis:
    port: int


def chart_redis_command(tmp_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The built-in Redis container's own command (its start script writes the ACL file),
    with the pod's paths moved under `tmp_path`, its Secrets as the hook Job leaves them,
    `redis-server` being the local server binary, on a loopback port."""
    c = render().get("Deployment", "rr-radix-router-redis")["spec"]["template"]["spec"][
        "containers"
    ][0]
    data, secrets, bin_dir = tmp_path / "data", tmp_path / "worker-passwords", tmp_path / "bin"
    for d in (data, secrets, bin_dir):
        d.mkdir(parents=True)
    for user, password in PASSWORDS.items():
        if user != "radix-router":
            (secrets / user.removeprefix("radix-worker-")).write_text(password)
    (bin_dir / "redis-server").symlink_to(find_server_binary())
    script = c["args"][0].replace("/run/radix-worker-passwords", str(secrets))
    script = script.replace("/data/", f"{data}/")
    args = c["args"][1:]
    args[args.index("--port") + 1] = str(port)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "REDIS_PASSWORD": ADMIN,
        "ROUTER_PASSWORD": ROUTER_PW,
    }
    return [*c["command"], script, *args, "--bind", "127.0.0.1", "--dir", str(data)], env


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[ChartRedis]:
    port = free_port()
    argv, env = chart_redis_command(tmp_path / "redis", port)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    admin = redis.Redis(port=port, password=ADMIN)
    try:
        wait_until(lambda: _pings(admin) or proc.poll() is not None, 10)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield ChartRedis(port)
    finally:
        admin.close()
        proc.terminate()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


def test_the_chart_redis_refuses_to_start_without_a_worker_password(tmp_path: Path) -> None:
    argv, env = chart_redis_command(tmp_path, free_port())
    (tmp_path / "worker-passwords" / POD1).unlink()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"no Redis password for worker pod {POD1}" in done.stderr


def _url(server: ChartRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_services_run_with_their_role_users(acl_redis: ChartRedis, tmp_path) -> None:
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
        wait_health(router)  # listening: /readiness below answers instead of refusing
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


def test_each_role_is_refused_what_it_must_not_do(acl_redis: ChartRedis) -> None:
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
        lambda: worker.unlink(other),
        lambda: worker.rename(other, own),
        lambda: worker.delete("radixrouter:workers"),  # the old shared id set (issue 21)
        lambda: worker.sadd("radixrouter:workers", POD0),
        lambda: worker.srem("radixrouter:workers", POD1),
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


def test_a_worker_pod_heartbeats_only_as_itself(acl_redis: ChartRedis) -> None:
    """The registry's own writes (shared/wire/registry.py) with pod 0's user: as pod 0 they
    go through, as pod 1 the whole transaction is refused and nothing is written."""
    import asyncio

    from redis.asyncio import Redis

    from shared.wire.registry import Registry, WorkerRecord

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
        assert not await admin.exists("radixrouter:workers")  # membership is the hashes
        assert list(await Registry(admin).read_fleet()) == [POD0]
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


async def test_an_attach_sidecar_heartbeats_with_its_pods_credential(
    acl_redis: ChartRedis,
    fake: tuple[FakeSGLang, str],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """A stock engine's pod: the attach sidecar logs in as the pod's user with the password
    file (RADIX_WORKER_REDIS_PASSWORD_FILE, as the chart sets it) and registers the engine."""
    _, upstream = fake
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORDS[f"radix-worker-{POD1}"] + "\n")
    url = f"redis://radix-worker-{POD1}@127.0.0.1:{acl_redis.port}/0"
    env = {"RADIX_WORKER_REDIS_URL": url, "RADIX_WORKER_REDIS_PASSWORD_FILE": str(password_file)}
    args = ["worker", "attach", "--upstream", upstream, "--engine", "sglang", "--worker-id", POD1,
            "--interval", "0.2"]  # fmt: skip
    sidecar = Child("attach", args, upstream, tmp_path / "attach.log", env).start()
    admin = aioredis.Redis(port=acl_redis.port, password=ADMIN)
    try:
        deadline = time.monotonic() + 20
        while not await admin.exists(f"radixrouter:worker:{POD1}"):
            assert sidecar.alive and time.monotonic() < deadline, sidecar.tail()
            await asyncio.sleep(0.1)
        record = await admin.hgetall(f"radixrouter:worker:{POD1}")
        assert record[b"engine"] == b"sglang" and record[b"url"] == upstream.encode()
    finally:
        await asyncio.to_thread(sidecar.stop, 5)
    assert not await admin.exists(f"radixrouter:worker:{POD1}")  # it left on SIGTERM
    assert "NOPERM" not in sidecar.output(), sidecar.tail()
    await admin.aclose()
