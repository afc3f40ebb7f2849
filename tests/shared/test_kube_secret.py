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
        self.secrets[name] = body
        return web.json_response(body, status=201)


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/radix/secrets/{name}", fake.get)
    app.router.add_post("/api/v1/namespaces/radix/secrets", fake.post)
    with serve_in_thread(app) as url:
        yield fake, url


def _run(url: str, token_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBE_API_URL": url, "KUBE_TOKEN_FILE": str(token_file),
           "POD_NAMESPACE": "radix", "SECRET_LABELS": '{"app.kubernetes.io/name": "radix-router"}'}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "shared.kube_secret", NAME, *KEYS],
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
