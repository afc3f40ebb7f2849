"""`radix-worker download` against a local server that speaks the Hub's file API.

No internet: the server below answers the three calls huggingface_hub makes for a
snapshot (repo info for the commit, the recursive file tree, then HEAD and GET per
file under `/{repo}/resolve/{commit}/{file}`) from a tiny model folder made locally, and the
client is pointed at it with `HF_ENDPOINT`, the way a mirror is configured.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.app_thread import serve_in_thread
from tests.helm.chart import ROOT

REPO = "radix-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"


class FakeHub:
    """The Hub's file API for one repo at one commit; records what was asked."""

    def __init__(self, folder: Path, token: str | None = None) -> None:
        self.files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self.gets = 0

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    async def info(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path))
        if not self._authorized(request):
            return web.json_response({"error": "Invalid credentials"}, status=401)
        if request.match_info["revision"] not in ("main", COMMIT):
            return web.json_response(
                {"error": "Revision not found"},
                status=404,
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        siblings = [{"rfilename": name} for name in sorted(self.files)]
        return web.json_response({"id": REPO, "modelId": REPO, "sha": COMMIT, "siblings": siblings})

    async def tree(self, request: web.Request) -> web.Response:
        """The file listing (recursive), one page (no `Link` header: no next page)."""
        self.requests.append((request.method, request.path))
        if not self._authorized(request):
            return web.json_response({"error": "Invalid credentials"}, status=401)
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in sorted(self.files.items())
        ]
        return web.json_response(entries)

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if not self._authorized(request):
            return web.json_response({"error": "Invalid credentials"}, status=401)
        data = self.files.get(request.match_info["file"])
        if data is None:
            return web.json_response(
                {"error": "Entry not found"}, status=404, headers={"X-Error-Code": "EntryNotFound"}
            )
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "Content-Length": str(len(data)),
        }
        if request.method == "HEAD":
            return web.Response(headers=headers)
        self.gets += 1
        return web.Response(body=data, headers=headers)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}/revision/{revision}", self.info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{revision}", self.tree)
        app.router.add_get("/{owner}/{name}/resolve/{revision}/{file}", self.resolve)
        return app


@pytest.fixture
def hub(tiny_model_dir: Path) -> Iterator[tuple[FakeHub, str]]:
    fake = FakeHub(tiny_model_dir, token=TOKEN)
    with serve_in_thread(fake.app()) as url:
        yield fake, url


def _download(
    endpoint: str, target: Path, *extra: str, token: str | None = TOKEN, revision: str = "main"
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(target.parent / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_TOKEN", None)
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "download",
            REPO,
            "--revision",
            revision,
            "--dir",
            str(target),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_download_fills_the_folder_a_worker_loads(
    hub: tuple[FakeHub, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    fake, endpoint = hub
    target = tmp_path / "models" / "tiny"
    done = _download(endpoint, target)
    assert done.returncode == 0, done.stderr
    for name, data in fake.files.items():
        assert (target / name).read_bytes() == data, name
    assert (target / ".radix-revision").read_text().strip() == COMMIT
    assert COMMIT in done.stdout and str(target) in done.stdout
    first_gets = fake.gets
    assert first_gets == len(fake.files)
    # A restarted pod on the same volume: nothing fetched again.
    again = _download(endpoint, target)
    assert again.returncode == 0, again.stderr
    assert fake.gets == first_gets
    # And the worker's own loader takes the folder.
    from shared.tokens.tokenizer import Tokenizer

    assert Tokenizer.from_dir(str(target)).encode("hello")


def test_download_without_the_token_fails_clearly(hub: tuple[FakeHub, str], tmp_path: Path) -> None:
    _, endpoint = hub
    done = _download(endpoint, tmp_path / "m", token=None)
    assert done.returncode != 0
    assert "radix-worker download:" in done.stderr and REPO in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_revision_fails_clearly(hub: tuple[FakeHub, str], tmp_path: Path) -> None:
    _, endpoint = hub
    done = _download(endpoint, tmp_path / "m", revision="nope")
    assert done.returncode != 0 and "nope" in done.stderr and "Traceback" not in done.stderr
