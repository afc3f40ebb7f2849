"""Fixtures for the worker service tests: real servers on loopback, real Redis.

`WorkerThread` runs `create_app(config, engine)` on its own event loop in a thread, so
sync clients (the `openai` SDK's `OpenAI`) and async ones can both talk to it, and the
test can still run code on the server's loop (`call`) to read engine state safely.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from shared.config import WorkerConfig
from shared.procs import wait_until
from shared.redis_server import free_port
from worker.backends import build_engine
from worker.engine.types import Engine
from worker.http.app import create_app
from worker.http.state import STATE

T = TypeVar("T")


class WorkerThread:
    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        self.port = free_port()
        self.config = config.model_copy(update={"host": "127.0.0.1", "port": self.port})
        self.engine = engine if engine is not None else build_engine(self.config)
        self.url = f"http://127.0.0.1:{self.port}"
        self.app: web.Application | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def run(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the server's loop (engine state is loop-owned)."""

        async def wrap() -> T:
            return fn()

        return self.call(wrap())

    async def _start(self) -> None:
        self.app = create_app(self.config, self.engine)
        self.app[STATE].url = self.url
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        await asyncio.wait_for(self.app[STATE].booted.wait(), 60)

    def start(self) -> WorkerThread:
        self._thread.start()
        self.call(self._start(), timeout=90)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self.call(self._runner.cleanup(), timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> WorkerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sim_config(**overrides: Any) -> WorkerConfig:
    base: dict[str, Any] = {"engine": "sim", "worker_id": "sim-test", "cache_tokens": 50_000}
    return WorkerConfig.model_validate({**base, **overrides})


@pytest.fixture
def sim_worker() -> Iterator[WorkerThread]:
    with WorkerThread(sim_config()) as worker:
        yield worker


class WorkerProcess:
    """`python -m worker serve ...` as a child process, ready once /health says 200."""

    def __init__(self, *args: str, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"worker-{self.port}.log"
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "worker", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]  # fmt: skip
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=root, env=env
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited {self.proc.returncode}: {self.log()}")
            return self.healthy()

        wait_until(ready, timeout)
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    procs: list[WorkerProcess] = []

    def spawn(*args: str) -> WorkerProcess:
        procs.append(WorkerProcess(*args, tmp=tmp_path))
        return procs[-1]

    yield spawn
    for p in procs:
        p.close()
