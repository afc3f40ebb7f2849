"""Real worker and router processes for end-to-end tests, with bounded waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_healthy(p: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited {p.proc.returncode}: {p.tail()}")
        try:
            with urllib.request.urlopen(p.url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{p.name} not healthy in {timeout}s: {p.tail()}")


def spawn(name: str, args: list[str], url: str, log_dir: Path) -> Proc:
    log = log_dir / f"{name}-{time.monotonic_ns()}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
    return Proc(name, proc, url, log)


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
