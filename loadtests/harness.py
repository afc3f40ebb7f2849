"""The fleet harness for fault tests and `loadtests/faults.py`: a real fleet (a Redis
server, N sim workers, the router, each a process) and the client traffic run against it.

Every child runs the documented command line (`python -m worker serve ...`,
`python -m router serve ...`) through `shared.procs.Child`: its own session, so a kill
reaches exactly it and whatever it spawned, and one log file per child (the security
tests grep those). Router settings that have no CLI flag are passed as
`RADIX_ROUTER_<KEY>`, the way Helm and operators set them. Every wait is bounded.

`radix-router up` (router/local_fleet.py) starts a fleet too, but cannot kill or
restart one worker, nor give the router extra settings, which is what faults need.

Traffic: one request, a stream, or a steady load at fixed concurrency, each outcome
recorded (status, worker, SSE events). A request that cannot connect, or whose stream
does not close within its timeout, is an outcome too (status 0 with the reason), never
an exception, so a test can assert "nothing lost, nothing hung" over all of them.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shared import procs
from shared.procs import free_port, http_json, wait_until
from shared.procs import wait_health as _wait_health
from shared.redis_server import RedisServer

__all__ = ["Child", "E2EFleet", "Outcome", "SteadyLoad", "WorkerSpec", "burst", "call",
           "failures", "http_json", "prompt", "session", "sim_fleet", "wait_health",
           "wait_until"]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 45.0


class Child(procs.Child):
    """A `shared.procs.Child` run from this checkout (cwd and PYTHONPATH are its root), so
    children import the code under test even when the project is not installed."""

    def __post_init__(self) -> None:
        self.env = {"PYTHONPATH": str(ROOT), **self.env}
        self.cwd = self.cwd or ROOT


def wait_health(child: Child, timeout: float = START_TIMEOUT_S) -> None:
    _wait_health(child, timeout)


@dataclass(frozen=True)
class WorkerSpec:
    """Sim worker knobs: decode cost keeps requests in flight long enough to be hit."""

    decode_ms: float = 5.0
    prefill_us: float = 0.0
    cache_tokens: int = 50_000
    heartbeat_s: float = 0.2
    max_running: int = 256
    extra: tuple[str, ...] = ()


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
        self.others: list[Child] = []  # started by the caller, stopped with the fleet

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
        log = self.log_dir / f"{worker_id}.log"
        child = Child(worker_id, args, f"http://127.0.0.1:{port}", log).start()
        self.workers[worker_id] = child
        if wait:
            wait_health(child)
        return child

    def restart_worker(self, worker_id: str, wait: bool = True) -> Child:
        """Same id, same port: a new process, so a new epoch and an empty cache."""
        old = self.workers[worker_id]
        old.stop()
        child = old.fresh().start()
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
        log = self.log_dir / "router.log"
        url = f"http://127.0.0.1:{port}"
        self.router = Child("router", args, url, log, env).start()
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

    def adopt(self, child: Child) -> Child:
        """A process the caller started (e.g. another router replica) that this fleet
        stops with its own."""
        self.others.append(child)
        return child

    def close_processes(self) -> None:
        """Stop every child and Redis; the logs stay readable until `close`."""
        for child in self.others:
            child.stop(grace_s=5)
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


# -- traffic ----------------------------------------------------------------------
HUNG = "hung"  # the reason recorded when a response did not end within its timeout


@dataclass
class Outcome:
    status: int  # 0: no HTTP answer (connection refused/reset, or hung)
    worker: str | None = None  # x-radix-worker: the worker that answered
    events: list[str] = field(default_factory=list)  # SSE `data:` payloads, streams only
    reason: str = ""
    started: float = 0.0
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        if self.status != 200:
            return False
        return not self.events or self.events[-1] == "[DONE]"

    @property
    def stream_error(self) -> dict[str, Any] | None:
        """The error event a broken stream ends with, if it ends with one."""
        if not self.events or self.events[-1] == "[DONE]":
            return None
        try:
            last = json.loads(self.events[-1])
        except ValueError:
            return None
        return last.get("error") if isinstance(last, dict) else None


def session(timeout: float = 60.0) -> aiohttp.ClientSession:
    # No connection cap: the tests mean N requests at once, not N queued in the client.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout)
    )


def prompt(i: int, tokens: int = 40, groups: int = 8) -> dict[str, Any]:
    """Prompts in `groups` shared-prefix groups, so the cache-aware policy has trees."""
    return {
        "prompt": f"group {i % groups} shared prefix " * 20 + f"request {i}",
        "max_tokens": tokens,
    }


async def call(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float = 30.0,
    headers: dict[str, str] | None = None, first_event: asyncio.Event | None = None,
) -> Outcome:  # fmt: skip
    """POST one request (streamed when body["stream"]) and read it to the end;
    `first_event` is set when the first SSE event arrives."""
    out = Outcome(0, started=time.monotonic())
    try:
        async with asyncio.timeout(timeout):
            async with http.post(url, json=body, headers=headers) as r:
                out.status, out.worker = r.status, r.headers.get("x-radix-worker")
                if r.content_type == "text/event-stream":
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            out.events.append(line[6:].decode().strip())
                            if first_event is not None:
                                first_event.set()
                else:
                    await r.read()
    except TimeoutError:
        out.reason = HUNG
    except (aiohttp.ClientError, OSError) as e:
        out.reason = f"{type(e).__name__}: {e}"
    out.ended = time.monotonic()
    return out


async def burst(
    http: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], timeout: float = 30.0
) -> list[Outcome]:
    return list(await asyncio.gather(*(call(http, url, b, timeout) for b in bodies)))


class SteadyLoad:
    """`concurrency` clients, each sending the next request as soon as one ends."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, concurrency: int,
        body: Callable[[int], dict[str, Any]] = prompt, timeout: float = 30.0,
    ) -> None:  # fmt: skip
        self.http, self.url, self.concurrency = http, url, concurrency
        self.body, self.timeout = body, timeout
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    async def _client(self) -> None:
        while not self._stop.is_set():
            self._n += 1
            self.outcomes.append(await call(self.http, self.url, self.body(self._n), self.timeout))

    def start(self) -> SteadyLoad:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.concurrency)]
        return self

    async def stop(self) -> list[Outcome]:
        """Let every request in flight finish (each is bounded by its timeout)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes

    async def until_count(self, n: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while len(self.outcomes) < n:
                await asyncio.sleep(0.02)


def failures(outcomes: list[Outcome]) -> list[str]:
    """A readable line per failed outcome (for assertion messages)."""
    return [
        f"status={o.status} worker={o.worker} reason={o.reason} last={o.events[-1:]}"
        for o in outcomes
        if not o.ok
    ]
