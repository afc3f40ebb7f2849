"""A real fleet for fault tests: a Redis server, N sim workers and the router, each a process.

Every child runs the documented command line (`python -m worker serve ...`,
`python -m router serve ...`) in its own session, so a kill reaches exactly it and
whatever it spawned. Output goes to one log file per child (the security tests grep
those). Router settings that have no CLI flag are passed as `RADIX_ROUTER_<KEY>`,
the way Helm and operators set them. Every wait is bounded.

`router/local_fleet.py` (`radix-router up`) starts a fleet too, but cannot kill or
restart one worker, nor give the router extra settings, which is what faults need.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 45.0


@dataclass(frozen=True)
class WorkerSpec:
    """Sim worker knobs: decode cost keeps requests in flight long enough to be hit."""

    decode_ms: float = 5.0
    prefill_us: float = 0.0
    cache_tokens: int = 50_000
    heartbeat_s: float = 0.2
    max_running: int = 256
    extra: tuple[str, ...] = ()


@dataclass
class Child:
    name: str
    args: list[str]
    url: str
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
                start_new_session=True,
            )  # fmt: skip
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        self.signal(signal.SIGKILL)  # anything left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def http_json(
    url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> tuple[int, Any]:  # fmt: skip
    """(status, parsed JSON or None); errors with a body are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


class E2EFleet:
    def __init__(
        self, log_dir: Path | None = None, redis: bool = True, redis_password: str | None = None
    ) -> None:
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="radix-e2e-")
        self.log_dir = log_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.redis = RedisServer(password=redis_password).start() if redis else None
        self.workers: dict[str, Child] = {}
        self.router: Child | None = None
        self.router_headers: dict[str, str] = {}

    # -- workers --------------------------------------------------------------------
    def start_worker(
        self, worker_id: str, spec: WorkerSpec = WorkerSpec(), port: int | None = None,
        wait: bool = True,
    ) -> Child:  # fmt: skip
        port = port or free_port()
        args = [
            "worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--worker-id", worker_id, "--heartbeat-interval", str(spec.heartbeat_s),
            "--cache-tokens", str(spec.cache_tokens),
            "--sim-decode-ms-per-token", str(spec.decode_ms),
            "--sim-prefill-us-per-token", str(spec.prefill_us),
            "--max-running-requests", str(spec.max_running), *spec.extra,
        ]  # fmt: skip
        if self.redis is not None:
            args += ["--redis-url", self.redis.url]
        child = Child(
            worker_id, args, f"http://127.0.0.1:{port}", self.log_dir / f"{worker_id}.log", {}
        ).start()
        self.workers[worker_id] = child
        if wait:
            wait_health(child)
        return child

    def restart_worker(self, worker_id: str, wait: bool = True) -> Child:
        """Same id, same port: a new process, so a new epoch and an empty cache."""
        old = self.workers[worker_id]
        old.stop()
        child = Child(old.name, old.args, old.url, old.log, old.env).start()
        self.workers[worker_id] = child
        if wait:
            wait_health(child)
        return child

    # -- router ---------------------------------------------------------------------
    def start_router(
        self, settings: dict[str, object] | None = None, worker_urls: tuple[str, ...] = (),
        want_workers: int | None = None, headers: dict[str, str] | None = None,
    ) -> Child:  # fmt: skip
        """Settings are RouterConfig keys, passed as RADIX_ROUTER_<KEY> like a deployment."""
        port = free_port()
        args = ["router", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if self.redis is not None:
            args += ["--redis-url", self.redis.url]
        for url in worker_urls:
            args += ["--worker-url", url]
        base = {"discovery_interval": 0.2, "retry_backoff": 0.01, **(settings or {})}
        env = {f"RADIX_ROUTER_{k.upper()}": _env_value(v) for k, v in base.items()}
        self.router = Child(
            "router", args, f"http://127.0.0.1:{port}", self.log_dir / "router.log", env
        ).start()
        self.router_headers = headers or {}
        want = len(self.workers) if want_workers is None else want_workers
        wait_until(lambda: self.routable() >= want, START_TIMEOUT_S, self.router)
        return self.router

    def routable(self) -> int:
        """Workers the router would route to now (GET /workers; 0 while it is not up)."""
        assert self.router is not None
        try:
            status, body = http_json(
                self.router.url + "/workers", headers=self.router_headers, timeout=2.0
            )
        except OSError:
            return 0
        if status != 200 or not isinstance(body, dict):
            return 0
        return sum(1 for w in body["data"] if w["breaker"] != "open" and not w["draining"])

    def router_workers(self) -> dict[str, dict[str, Any]]:
        assert self.router is not None
        _, body = http_json(self.router.url + "/workers", headers=self.router_headers)
        return {w["worker_id"]: w for w in body["data"]}

    def router_metric(self, name: str) -> float:
        """Sum of a Prometheus sample family from the router's /metrics (0 if absent)."""
        assert self.router is not None
        req = urllib.request.Request(self.router.url + "/metrics", headers=self.router_headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close_processes(self) -> None:
        """Stop every child and Redis; the logs stay readable until `close`."""
        if self.router is not None:
            self.router.stop(grace_s=5)
        for child in self.workers.values():
            child.stop(grace_s=5)
        if self.redis is not None:
            self.redis.stop()

    def close(self) -> None:
        self.close_processes()
        if self.redis is not None:
            self.redis.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> E2EFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def wait_until(check: Any, timeout: float, child: Child | None = None) -> float:
    """Poll `check()` until true; fail with the child's log if it dies or time runs out."""
    start = time.monotonic()
    while not check():
        if child is not None and child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited {child.proc.returncode}: {child.output()[-3000:]}"
            )
        if time.monotonic() - start > timeout:
            tail = child.output()[-3000:] if child else ""
            raise TimeoutError(f"condition not met within {timeout}s {tail}")
        time.sleep(0.05)
    return time.monotonic() - start


def wait_health(child: Child, timeout: float = START_TIMEOUT_S) -> None:
    def healthy() -> bool:
        try:
            return http_json(child.url + "/health", timeout=1.0)[0] == 200
        except OSError:
            return False

    wait_until(healthy, timeout, child)


def sim_fleet(workers: int, spec: WorkerSpec | None = None) -> E2EFleet:
    """Redis + `workers` sim workers named w0..w{n-1}, started together, all healthy."""
    fleet = E2EFleet()
    try:
        for i in range(workers):
            fleet.start_worker(f"w{i}", spec or WorkerSpec(), wait=False)
        for child in fleet.workers.values():
            wait_health(child)
    except BaseException:
        fleet.close()
        raise
    return fleet
