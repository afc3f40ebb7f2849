"""The config files and environment the chart gives each pod load through the services'
own loader (shared.config.load_config), with the Redis URL, keys and per-pod values
arriving where the services read them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
import yaml

from shared.config import RouterConfig, WorkerConfig, load_config
from tests.helm.chart import (
    CHART_DIR,
    EXAMPLES,
    EXAMPLES_DIR,
    Rendered,
    container,
    load_values,
    merged,
    pod_spec,
    render,
)
from tests.helm.kube_env import (
    FakePod,
    config_flag,
    container_env,
    mount_config_files,
    run_init_container,
)

CASES = [None, *EXAMPLES]
IDS = ["defaults", *(p.stem for p in EXAMPLES)]
ROUTER = "rr-radix-router-router"
# The Secrets values-production.yaml tells the user to create before install.
PROD_REDIS_URL = "rediss://radix-router:s3cret@redis.prod.internal:6380/0?ssl_ca_certs=/etc/radix-redis-tls/ca.crt"
PROD_WORKER_URL = "rediss://radix-worker:w0rker@redis.prod.internal:6380/0?ssl_ca_certs=/etc/radix-redis-tls/ca.crt"
# What the chart's hook Job (python -m shared.kube_secret) creates for the built-in Redis.
GENERATED = {"redis-password": "admin-Pw_1", "router-password": "router-Pw_2"}
WORKER_SECRET = "rr-radix-router-redis-workers"
PROD_SECRETS = {
    "radix-redis": {"router-url": PROD_REDIS_URL, "worker-url": PROD_WORKER_URL},
    "radix-auth": {"api-keys": "key-a,key-b", "admin-key": "admin-1"},
    "rr-radix-router-redis-auth": GENERATED,
}


def job_secrets(rendered: Rendered) -> dict[str, dict[str, str]]:
    """The Secrets the hook Job would create (`kube_secret NAME KEY... -- NAME KEY...`),
    with a made-up password per key; PROD_SECRETS when there is no Job."""
    jobs = rendered.of_kind("Job")
    if not jobs:
        return PROD_SECRETS
    (job,) = jobs
    groups: list[list[str]] = [[]]
    for arg in pod_spec(job)["containers"][0]["args"]:
        groups.append([]) if arg == "--" else groups[-1].append(arg)
    made = {name: {key: f"pw_{key}" for key in keys} for name, *keys in groups}
    return {**PROD_SECRETS, **made, "rr-radix-router-redis-auth": GENERATED}


def router_config(
    rendered: Rendered, tmp_path: Path, pod: FakePod
) -> tuple[RouterConfig, dict[str, str]]:
    deployment = rendered.get("Deployment", ROUTER)
    c = container(deployment, "router")
    root = mount_config_files(rendered, deployment, c, tmp_path / "router")
    env = container_env(rendered, c, pod)
    return load_config(RouterConfig, file=root / config_flag(c).lstrip("/"), environ=env), env


def worker_configs(
    rendered: Rendered, tmp_path: Path, pod_ip: str = "10.1.2.3"
) -> dict[str, WorkerConfig]:
    """Config of pod 0 of every worker StatefulSet, by StatefulSet name."""
    out = {}
    for sts in rendered.of_kind("StatefulSet"):
        name = sts["metadata"]["name"]
        if sts["spec"]["template"]["metadata"]["labels"]["radix-router.io/engine"] in STOCK:
            continue  # a stock engine: no worker config (see test_stock_engines_*)
        pod = FakePod(name=f"{name}-0", ip=pod_ip, external_secrets=job_secrets(rendered))
        c = container(sts, "worker")
        root = mount_config_files(rendered, sts, c, tmp_path / name)
        env = container_env(rendered, c, pod)
        if "RADIX_WORKER_REDIS_PASSWORD_FILE" in env:
            # The pod's init container copies its own password where the worker reads it.
            done = run_init_container(sts, "redis-credential", pod, root)
            assert done.returncode == 0, done.stderr
            path = env["RADIX_WORKER_REDIS_PASSWORD_FILE"]
            env["RADIX_WORKER_REDIS_PASSWORD_FILE"] = str(root / path.lstrip("/"))
        out[name] = load_config(WorkerConfig, file=root / config_flag(c).lstrip("/"), environ=env)
    return out


STOCK = ("sglang", "vllm")


def redis_users(rendered: Rendered) -> dict[str, str]:
    """user -> password of the built-in Redis's ACL file, as its start script writes it."""
    (redis,) = rendered.component("Deployment", "redis")
    c = container(redis, "redis")
    secrets = job_secrets(rendered)
    env = container_env(rendered, c, FakePod(name="redis-0", external_secrets=secrets))
    users = {}
    for line in c["args"][0].splitlines():
        parts = re.match(r"\s*user (\S+) on >(\$\(cat [^)]*\)|\S+) ", line)
        if parts:
            password = parts.group(2)
            for name, value in env.items():
                password = password.replace("${" + name + "}", value)
            if found := re.fullmatch(r"\$\(cat /run/radix-worker-passwords/([-\w.]+)\)", password):
                password = secrets[WORKER_SECRET][found.group(1)]
            users[parts.group(1)] = password
    return users


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_router_config_loads(path: Path | None, tmp_path: Path) -> None:
    values = load_values(path)
    rendered = render(values)
    config, _ = router_config(
        rendered, tmp_path, FakePod(name="router-x", external_secrets=PROD_SECRETS)
    )
    port = container(rendered.get("Deployment", ROUTER), "router")["ports"][0]["containerPort"]
    assert config.port == port and config.host == "0.0.0.0"
    expected = (values or {}).get("routerSpec", {}).get("config", {})
    for key, value in expected.items():
        got = getattr(config, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_worker_configs_load(path: Path | None, tmp_path: Path) -> None:
    values = load_values(path)
    rendered = render(values)
    configs = worker_configs(rendered, tmp_path)
    assert configs
    dns = (values or {}).get("servingEngineSpec", {}).get("advertise") == "dns"
    for name, config in configs.items():
        sts = rendered.get("StatefulSet", name)
        c = container(sts, "worker")
        assert config.worker_id == f"{name}-0", "the worker id is the pod's stable name"
        assert config.port == c["ports"][0]["containerPort"]
        host = f"{name}-0.{name}.radix.svc" if dns else "10.1.2.3"
        assert config.advertise_url == f"http://{host}:{config.port}"
        assert config.served_model_name
        if config.engine != "sim":
            mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "models"]
            assert mounts and config.model and config.model.startswith(mounts[0] + "/")


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_redis_url_reaches_both_services(path: Path | None, tmp_path: Path) -> None:
    rendered = render(load_values(path))
    router, _ = router_config(rendered, tmp_path, FakePod(external_secrets=PROD_SECRETS))
    workers = worker_configs(rendered, tmp_path)
    assert router.redis_url and all(w.redis_url for w in workers.values())
    assert all(w.redis_prefix == router.redis_prefix for w in workers.values())
    if rendered.component("Deployment", "redis"):
        # Each role logs in as its own ACL user, with the password Redis was started with.
        users = redis_users(rendered)
        host = "rr-radix-router-redis.radix.svc:6379/0"
        assert router.redis_url == f"redis://radix-router:{users['radix-router']}@{host}"
        assert users["radix-router"] == GENERATED["router-password"]
        for name, w in workers.items():
            # Pod 0's own user, and its own password from the file its init container wrote.
            assert w.redis_url == f"redis://radix-worker-{name}-0@{host}"
            assert w.redis_password_file
            password = Path(w.redis_password_file).read_text()
            assert password == users[f"radix-worker-{name}-0"] == f"pw_{name}-0"
        # The URL names the chart's Redis Service and port.
        svc = rendered.get("Service", "rr-radix-router-redis")
        assert urlsplit(router.redis_url).port == svc["spec"]["ports"][0]["port"]
    else:
        assert router.redis_url == PROD_REDIS_URL
        assert all(w.redis_url == PROD_WORKER_URL for w in workers.values())


def test_external_redis_tls_reaches_redis_py(tmp_path: Path) -> None:
    """Password and TLS travel in the URL; the CA is mounted where the URL says."""
    rendered = render(load_values(EXAMPLES_DIR / "values-production.yaml"))
    config, _ = router_config(rendered, tmp_path, FakePod(external_secrets=PROD_SECRETS))
    pool = aioredis.Redis.from_url(config.redis_url).connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert pool.connection_kwargs["password"] == "s3cret"
    assert pool.connection_kwargs["username"] == "radix-router"
    ca = pool.connection_kwargs["ssl_ca_certs"]
    for w in [rendered.get("Deployment", ROUTER), *rendered.of_kind("StatefulSet")]:
        mounts = {m["mountPath"] for c in pod_spec(w)["containers"] for m in c["volumeMounts"]}
        assert str(Path(ca).parent) in mounts, w["metadata"]["name"]


def test_built_in_redis_passwords_are_never_rendered_so_never_rotate() -> None:
    """No `lookup`, no random value in a template: a GitOps re-render cannot change the
    password. The Secret comes from the hook Job (created once), or is the user's own."""
    for template in (CHART_DIR / "templates").glob("*"):
        text = template.read_text() if template.is_file() else ""
        assert not re.search(r'lookup\s+"', text) and "randAlpha" not in text, template.name
    rendered = render(None)
    assert rendered.find("Secret", "rr-radix-router-redis-auth") is None
    job = rendered.get("Job", "rr-radix-router-redis-secret-init")
    c = pod_spec(job)["containers"][0]
    assert c["command"] == ["python", "-m", "shared.kube_secret"]
    pods = ["rr-radix-router-worker-qwen-0", "rr-radix-router-worker-qwen-1"]
    assert c["args"] == ["rr-radix-router-redis-auth", *GENERATED, "--", WORKER_SECRET, *pods]
    # With your own admin/router Secret the Job still makes the worker pods' passwords.
    own = render(merged(None, **{"redis.builtin.auth.existingSecret": "mine"}))
    assert pod_spec(own.get("Job", "rr-radix-router-redis-secret-init"))["containers"][0][
        "args"
    ] == [WORKER_SECRET, *pods]


def test_api_keys_and_admin_key_reach_the_router_not_the_configmap(tmp_path: Path) -> None:
    values = merged(None, **{"auth.apiKeys": ["k-one", "k-two"], "auth.adminKey": "adm-1"})
    rendered = render(values)
    config, _ = router_config(rendered, tmp_path, FakePod(external_secrets=PROD_SECRETS))
    assert config.api_keys == ("k-one", "k-two") and config.admin_key == "adm-1"
    for cm in rendered.of_kind("ConfigMap"):
        text = str(cm["data"])
        assert "k-one" not in text and "adm-1" not in text
    # With no keys configured the router runs open, and no auth Secret is made.
    bare = render(None)
    config, _ = router_config(bare, tmp_path / "bare", FakePod(external_secrets=PROD_SECRETS))
    assert config.api_keys == () and config.admin_key is None


def test_keys_from_an_existing_secret(tmp_path: Path) -> None:
    rendered = render(load_values(EXAMPLES_DIR / "values-production.yaml"))
    config, _ = router_config(rendered, tmp_path, FakePod(external_secrets=PROD_SECRETS))
    assert config.api_keys == ("key-a", "key-b") and config.admin_key == "admin-1"


@pytest.mark.parametrize(
    ("changes", "sync"),
    [
        ({}, False),
        ({"routerSpec.replicaCount": 2}, True),
        ({"routerSpec.autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}, True),
        ({"routerSpec.replicaCount": 3, "routerSpec.sync": False}, False),
        ({"routerSpec.sync": True}, True),
    ],
    ids=["one-replica", "two-replicas", "hpa", "forced-off", "forced-on"],
)
def test_router_replicas_turn_sync_on(changes: dict[str, Any], sync: bool, tmp_path: Path) -> None:
    rendered = render(merged(None, **changes))
    config, _ = router_config(rendered, tmp_path, FakePod(external_secrets=PROD_SECRETS))
    assert config.sync is sync
    assert ("sync on" in rendered.notes) is sync


def test_router_cli_loads_the_pod_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's own `serve` argument parsing on the pod's exact args and environment."""
    cli = pytest.importorskip("router.cli")
    rendered = render(merged(None, **{"routerSpec.replicaCount": 2, "auth.apiKeys": ["k1"]}))
    c = container(rendered.get("Deployment", ROUTER), "router")
    root = mount_config_files(rendered, rendered.get("Deployment", ROUTER), c, tmp_path)
    for key, value in container_env(rendered, c, FakePod(external_secrets=PROD_SECRETS)).items():
        monkeypatch.setenv(key, value)
    argv = [str(root / a.lstrip("/")) if a.startswith("/etc/") else a for a in c["args"]]
    config = cli.serve_config(cli.build_parser().parse_args(argv))
    assert config.sync is True and config.api_keys == ("k1",)
    assert config.redis_url and config.redis_url.startswith("redis://radix-router:")


# The chart's default model entry.
QWEN = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["servingEngineSpec"]["modelSpec"][0]


@pytest.mark.parametrize(
    ("changes", "count"),
    [
        ({}, 2),  # replicaCount of the default entry
        ({"servingEngineSpec.modelSpec": [{**QWEN, "replicaCount": 3}]}, 3),
        # KEDA: every pod the scaler may make, up to its maximum.
        (
            {
                "servingEngineSpec.modelDefaults.keda.enabled": True,
                "servingEngineSpec.modelDefaults.keda.maxReplicaCount": 5,
            },
            5,
        ),
    ],
)
def test_one_redis_user_per_worker_pod(changes: dict, count: int, tmp_path: Path) -> None:
    rendered = render(merged(None, **changes))
    sts = rendered.get("StatefulSet", "rr-radix-router-worker-qwen")
    pods = [f"rr-radix-router-worker-qwen-{i}" for i in range(count)]
    users = redis_users(rendered)
    assert sorted(users) == sorted(
        ["default", "radix-router", *(f"radix-worker-{p}" for p in pods)]
    )
    assert len(set(users.values())) == len(users)  # no two users share a password
    # The last pod starts with its own credential; the next ordinal has no user and its
    # init container fails saying what to raise.
    secrets = job_secrets(rendered)
    last = FakePod(name=pods[-1], external_secrets=secrets)
    assert run_init_container(sts, "redis-credential", last, tmp_path / "last").returncode == 0
    assert (tmp_path / "last/run/radix-redis/password").read_text() == f"pw_{pods[-1]}"
    beyond = FakePod(name=f"rr-radix-router-worker-qwen-{count}", external_secrets=secrets)
    done = run_init_container(sts, "redis-credential", beyond, tmp_path / "beyond")
    assert done.returncode == 1, done
    assert f"no Redis user for worker pod rr-radix-router-worker-qwen-{count}" in done.stderr
    assert "raise it and run helm upgrade" in done.stderr
    assert not (tmp_path / "beyond/run/radix-redis/password").exists()
    # Scaling changes the users, not the pod template: no worker restarts for it.
    two = render(merged(None)).get("StatefulSet", "rr-radix-router-worker-qwen")
    assert sts["spec"]["template"] == two["spec"]["template"]
    # The worker container sees only its own password, never the Secret of all of them.
    mounts = {m["name"] for m in container(sts, "worker")["volumeMounts"]}
    assert "redis-credential" in mounts and "worker-passwords" not in mounts
