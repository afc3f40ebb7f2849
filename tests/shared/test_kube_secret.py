"""`python -m shared.kube_secret` (the chart's hook Job) against a fake Kubernetes API:
it creates the Secret once and leaves an existing one untouched, so re-running it on
every upgrade or GitOps sync never rotates the Redis passwords."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from shared.procs import free_port
from tests.app_thread import serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
NAME = "rr-radix-router-redis-auth"
KEYS = ["redis-password", "router-password", "worker-password"]


class FakeApi:
    def __init__(self) -> None:
        self.secrets: dict[str, dict] = {}
        self.posts = 0
        self.patches = 0
        self.tokens: list[str] = []

    async def get(self, request: web.Request) -> web.Response:
        self.tokens.append(request.headers.get("Authorization", ""))
        secret = self.secrets.get(request.match_info["name"])
        return web.json_response(
            secret or {"kind": "Status", "code": 404}, status=200 if secret else 404
        )

    async def post(self, request: web.Request) -> web.Response:
        self.posts += 1
        body = await request.json()
        name = body["metadata"]["name"]
        if name in self.secrets:
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        body["metadata"]["resourceVersion"] = "1"
        self.secrets[name] = body
        return web.json_response(body, status=201)

    async def patch(self, request: web.Request) -> web.Response:
        """A merge patch, refused (409) when its resourceVersion is not the current one."""
        assert request.content_type == "application/merge-patch+json"
        self.patches += 1
        patch = await request.json()
        secret = self.secrets[request.match_info["name"]]
        if patch["metadata"]["resourceVersion"] != secret["metadata"]["resourceVersion"]:
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        secret["data"] = {**secret["data"], **patch["data"]}
        secret["metadata"]["resourceVersion"] = str(int(secret["metadata"]["resourceVersion"]) + 1)
        return web.json_response(secret)


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/radix/secrets/{name}", lambda r: fake.get(r))
    app.router.add_post("/api/v1/namespaces/radix/secrets", fake.post)
    app.router.add_patch("/api/v1/namespaces/radix/secrets/{name}", fake.patch)
    with serve_in_thread(app) as url:
        yield fake, url


def _run(url: str, token_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBE_API_URL": url, "KUBE_TOKEN_FILE": str(token_file),
           "POD_NAMESPACE": "radix", "SECRET_LABELS": '{"app.kubernetes.io/name": "radix-router"}'}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "shared.kube_secret", *(args or (NAME, *KEYS))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_creates_once_then_leaves_it_alone(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    fake, url = api
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    first = _run(url, token)
    assert first.returncode == 0 and "created" in first.stdout, first.stderr
    secret = fake.secrets[NAME]
    passwords = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert sorted(passwords) == sorted(KEYS)
    assert all(
        len(p) >= 24 and p.replace("-", "").replace("_", "").isalnum() for p in passwords.values()
    )
    assert len(set(passwords.values())) == 3
    assert secret["metadata"]["labels"] == {"app.kubernetes.io/name": "radix-router"}
    # Every later run (upgrade, re-sync) finds it and changes nothing.
    for _ in range(2):
        again = _run(url, token)
        assert again.returncode == 0 and "exists" in again.stdout
    assert fake.posts == 1 and fake.secrets[NAME] is secret
    assert set(fake.tokens) == {"Bearer sa-token"}


def test_an_api_error_fails_the_job(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    done = _run(f"http://127.0.0.1:{free_port()}", token)  # nothing listens
    assert done.returncode == 1 and "kube_secret:" in done.stderr and "Traceback" not in done.stderr


def test_adds_worker_keys_and_never_changes_one(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    """A scale-up adds worker pods: their passwords are added, the others stay as they are;
    a second Secret follows `--`; a Secret of no keys (no worker pods yet) is made empty."""
    fake, url = api
    token = tmp_path / "token"
    token.write_text("t")
    workers = "rr-radix-router-redis-workers"
    first = _run(url, token, NAME, *KEYS, "--", workers, "w-0", "w-1")
    assert first.returncode == 0 and first.stdout.count("created") == 2, first.stderr
    before = dict(fake.secrets[workers]["data"])
    grown = _run(url, token, NAME, *KEYS, "--", workers, "w-0", "w-1", "w-2")
    assert grown.returncode == 0 and "added 1 keys" in grown.stdout, grown.stderr
    after = fake.secrets[workers]["data"]
    assert sorted(after) == ["w-0", "w-1", "w-2"] and {k: after[k] for k in before} == before
    assert after["w-2"] not in before.values() and fake.patches == 1
    # Fewer pods later (scale-down): nothing is removed or changed.
    again = _run(url, token, workers, "w-0")
    assert again.returncode == 0 and "exists" in again.stdout and fake.patches == 1
    empty = _run(url, token, "empty")
    assert empty.returncode == 0 and fake.secrets["empty"]["data"] == {}


def test_a_concurrent_writer_is_never_overwritten(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    """The patch names the version it read: when another run added a key in between, the
    API refuses it (409) and this run looks again instead of replacing that key."""
    fake, url = api
    token = tmp_path / "token"
    token.write_text("t")
    fake.secrets["s"] = {"metadata": {"name": "s", "resourceVersion": "1"}, "data": {"a": "eA=="}}
    original_get = fake.get
    raced = []

    async def racing_get(request: web.Request) -> web.Response:
        response = await original_get(request)
        if not raced:  # another run adds "b" right after this run read the Secret
            raced.append(True)
            secret = fake.secrets["s"]
            secret["data"] = {**secret["data"], "b": "Yg=="}
            secret["metadata"]["resourceVersion"] = "2"
        return response

    fake.get = racing_get  # type: ignore[method-assign]
    done = _run(url, token, "s", "a", "b", "c")
    assert done.returncode == 0 and "added 1 keys" in done.stdout, done.stderr
    assert fake.secrets["s"]["data"]["b"] == "Yg==" and "c" in fake.secrets["s"]["data"]
