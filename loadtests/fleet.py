"""A local sim fleet for benchmarks and the CI smoke test: Redis, N sim workers, a router.

Workers start once; the router can be restarted with another policy while the workers
stay (`restart_router`), and `flush` empties every worker's cache between runs, so
each policy meets the same cold fleet. Children run as `python -m worker serve` and
`python -m router serve` (the documented command line), output to log files in a
temporary folder, each in its own process group so stopping kills what it spawned.
"""

from __future__ import annotations

import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.harness import Child
from shared.procs import answers_health as answers
from shared.procs import free_port, http_json, wait_until
from shared.redis_server import RedisServer


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 2
    cache_tokens: int = 65_536
    prefill_us_per_token: float = 30.0
    decode_ms_per_token: float = 3.0
    max_running_requests: int = 8
    start_timeout_s: float = 60.0


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "cache_aware"
    # Extra RouterConfig keys (e.g. balance_mode), passed as RADIX_ROUTER_<KEY>.
    settings: dict[str, str] = field(default_factory=dict)


def _health(url: str) -> dict[str, Any] | None:
    """The /health body, whatever the status (503 "no workers" still carries one)."""
    try:
        body = http_json(url + "/health", timeout=2.0)[1]
    except OSError:
        return None
    return body if isinstance(body, dict) else None


class LocalFleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self._dir = tempfile.TemporaryDirectory(prefix="radix-fleet-")
        self.redis = RedisServer()
        self.worker_urls: list[str] = []
        self._workers: list[Child] = []
        self._router: Child | None = None
        self.router_url = ""

    @property
    def log_dir(self) -> Path:
        return Path(self._dir.name)

    def _spawn(
        self, name: str, args: list[str], url: str, env: dict[str, str] | None = None
    ) -> Child:
        return Child(name, args, url, self.log_dir / f"{name}.log", env or {}).start()

    def _wait(self, child: Child, want_workers: int = 0) -> None:
        def ready() -> bool:
            body = _health(child.url)
            return body is not None and (not want_workers or body.get("workers") == want_workers)

        wait_until(ready, self.spec.start_timeout_s, child, poll_s=0.1)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def start(self, router: RouterSpec | None = None) -> LocalFleet:
        s = self.spec
        try:
            self.redis.start()
            for i in range(s.workers):
                port = free_port()
                args = [
                    "worker", "serve", "--engine", "sim", "--host", "127.0.0.1",
                    "--port", str(port), "--redis-url", self.redis.url, "--worker-id", f"w{i}",
                    "--cache-tokens", str(s.cache_tokens),
                    "--sim-prefill-us-per-token", str(s.prefill_us_per_token),
                    "--sim-decode-ms-per-token", str(s.decode_ms_per_token),
                    "--max-running-requests", str(s.max_running_requests),
                    "--heartbeat-interval", "0.5", "--log-level", "WARNING",
                ]  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                self._workers.append(self._spawn(f"worker-w{i}", args, url))
                self.worker_urls.append(url)
            for child in self._workers:
                self._wait(child)
            self.restart_router(router or RouterSpec())
        except BaseException:
            self.stop()
            raise
        return self

    def restart_router(self, router: RouterSpec) -> str:
        self._stop_router()
        port = free_port()
        env = {f"RADIX_ROUTER_{k.upper()}": v for k, v in router.settings.items()}
        args = [
            "router", "serve", "--policy", router.policy, "--redis-url", self.redis.url,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
        ]  # fmt: skip
        self.router_url = f"http://127.0.0.1:{port}"
        self._router = self._spawn("router", args, self.router_url, env)
        self._wait(self._router, want_workers=self.spec.workers)
        return self.router_url

    def start_sglang_router(self, python: str) -> str:
        """SGLang's Rust router (`sglang-router`, installed in the venv of `python`) over
        the same workers, with its cache_aware policy at its defaults (the same
        thresholds as ours: cache 0.3, balance 64 / 1.5). It learns workers from the
        URLs, not from Redis."""
        self._stop_router()
        port = free_port()
        args = [
            "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *self.worker_urls,
        ]  # fmt: skip
        self.router_url = f"http://127.0.0.1:{port}"
        log = self.log_dir / "sglang-router.log"
        self._router = Child("sglang-router", args, self.router_url, log, python=python).start()
        wait_until(lambda: _health(self.router_url) is not None or answers(self.router_url),
                   self.spec.start_timeout_s, self._router, poll_s=0.2)  # fmt: skip
        return self.router_url

    def worker_requests(self) -> dict[str, int]:
        """Requests each worker has answered so far (its own /metrics), by worker id."""
        counts = {}
        for i, url in enumerate(self.worker_urls):
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            counts[f"w{i}"] = int(sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("radix_worker_requests_total{") and 'status="200"' in line
            ))  # fmt: skip
        return counts

    def flush(self) -> None:
        """Empty every worker's cache (they are idle between runs)."""
        for url in self.worker_urls:
            req = urllib.request.Request(url + "/flush_cache", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status != 200:
                    raise RuntimeError(f"flush_cache on {url} answered {r.status}")

    def _stop_router(self) -> None:
        if self._router is not None:
            self._router.stop()
            self._router = None

    def stop(self) -> None:
        self._stop_router()
        for child in self._workers:
            child.stop()
        self._workers.clear()
        self.redis.close()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
