"""What `radix-router up` checks before it starts anything, so that a problem is one
clear line (`StartError`) instead of a child's traceback in a log folder:

- the router's port: another process listening there would answer our health check
  and be announced as our router;
- what the children need: the worker package, torch for the radix engine, a Redis
  server binary unless `--redis-url`. Found with `find_spec`, which imports nothing
  (the router never imports `worker`);
- that a `--redis-url` answers PING within `REDIS_CHECK_S`: without it no worker can
  register and the router never becomes healthy, which `up` used to find out only at
  its start timeout (120 s), with no word of Redis.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from shared.redis_server import find_server_binary
from shared.wire.registry import redact_url

REDIS_CHECK_S = 3.0


class StartError(RuntimeError):
    pass


def check_port(host: str, port: int) -> None:
    """Raise StartError if `port` on `host` cannot be bound (0: any port, always fine).

    SO_REUSEADDR as aiohttp sets it, so a socket in TIME_WAIT is no obstacle but a
    listening one is."""
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as e:
        raise StartError(f"cannot resolve --host {host}: {e}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise StartError(
                f"port {port} on {host} is taken ({e.strerror}): stop what listens there, "
                "or pass --port N (--port 0 picks a free one)"
            ) from None


CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def check_prerequisites(
    engine: str, redis_url: str | None, find_spec: Callable[[str], Any] = importlib.util.find_spec
) -> None:
    """What the children will need, checked before any starts: a missing piece is one
    clear line here rather than a child's traceback in a log (`find_spec` imports nothing)."""
    if find_spec("worker") is None:
        raise StartError(
            "the worker package is not installed here: pip install -e '.[worker,local]'"
        )
    if engine == "radix" and find_spec("torch") is None:
        raise StartError(f"--engine radix needs torch: {CPU_TORCH} (or use --engine sim)")
    if not redis_url:
        try:
            find_server_binary()
        except RuntimeError as e:
            raise StartError(str(e)) from None


def check_redis(url: str, timeout_s: float = REDIS_CHECK_S) -> None:
    """Raise StartError naming the URL (password redacted) and the error when the Redis
    at `url` does not answer PING within `timeout_s`."""
    try:
        with Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) as r:
            r.ping()
    except (RedisError, OSError, ValueError) as e:
        raise StartError(
            f"Redis at {redact_url(url)} is unreachable ({type(e).__name__}: {e}): "
            "start it, fix --redis-url, or leave --redis-url out to have `up` start one"
        ) from None
