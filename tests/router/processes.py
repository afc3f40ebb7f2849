"""Real worker and router processes for end-to-end tests, with bounded waits.

A thin layer over `loadtests.fleet.Child` (itself `shared.procs.Child` run from this
checkout) for tests that start single processes next to an in-process router.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from loadtests.fleet import ROOT, Child
from shared.procs import free_port, wait_health

__all__ = ["ROOT", "Proc", "spawn", "start_sim_worker", "wait_healthy"]


class Proc(Child):
    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:  # type: ignore[override]
        """Send `sig` first (e.g. SIGKILL for a crash), then the usual TERM-grace-KILL."""
        if sig != signal.SIGTERM and self.alive:
            self.signal(sig)
        return super().stop(grace_s)


def wait_healthy(p: Proc, timeout: float = 60.0) -> None:
    wait_health(p, timeout, poll_s=0.1)


def spawn(name: str, args: list[str], url: str, log_dir: Path) -> Proc:
    """`args` is the Python command line after the interpreter: ["-m", module, ...]."""
    if args[:1] != ["-m"]:
        raise ValueError(f"spawn runs modules: args must start with '-m', got {args[:2]}")
    log = log_dir / f"{name}-{time.monotonic_ns()}.log"
    return Proc(name, args[1:], url, log).start()


def start_sim_worker(
    worker_id: str, redis_url: str, log_dir: Path, *, port: int | None = None, heartbeat: float = 0.2,
    cache_tokens: int = 20000, decode_ms: float = 0.0, prefill_us: float = 0.0,
) -> Proc:  # fmt: skip
    port = port or free_port()
    args = ["-m", "worker", "serve", "--engine", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--redis-url", redis_url, "--worker-id", worker_id, "--heartbeat-interval", str(heartbeat),
            "--cache-tokens", str(cache_tokens), "--sim-decode-ms-per-token", str(decode_ms),
            "--sim-prefill-us-per-token", str(prefill_us), "--log-level", "WARNING"]  # fmt: skip
    p = spawn(worker_id, args, f"http://127.0.0.1:{port}", log_dir)
    wait_healthy(p)
    return p
