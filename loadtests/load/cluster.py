"""The local cluster of benchmarks and end-to-end tests: a Redis server, sim workers
and routers, each a real process started the documented way (`python -m worker serve
...`, `python -m router serve ...`).

Every child is a `shared.procs.Child` run from this checkout (cwd and PYTHONPATH are
its root, so children import the code under test even when nothing is installed): its
own session, so a kill reaches exactly it and whatever it spawned, and one log file per
child (the security tests grep those). Router settings without a CLI flag are passed as
`RADIX_ROUTER_<KEY>`, the way Helm and operators set them. Every wait is bounded.

What the callers need of it: start, kill and restart one worker (fault tests); start
the router again with another policy while the workers stay, and flush every worker's
cache between runs, so each policy meets the same cold workers (`compare`); more routers
next to the first (`replicas`, the replica-sync tests), stopped with the cluster.
`radix-router up` (router/up/local_fleet.py) is the user's own: it starts one and keeps
it until Ctrl-C, and never needs any of that.
"""

from __future__ import annotations

import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import procs
from shared.procs import free_port, http_json, wait_until
from shared.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 45.0


class Child(procs.Child):
    """A `shared.procs.Child` run from this checkout."""

    def __post_init__(self) -> None:
        self.env = {"PYTHONPATH": str(ROOT), **self.env}
        self.cwd = self.cwd or ROOT


def wait_health(child: Child, timeout: float = START_TIMEOUT_S) -> None:
    procs.wait_health(child, timeout)


def serve(
    name: str, args: list[str], port: int, log_dir: Path, *, tree: Path = ROOT,
    env: dict[str, str] | None = None, python: str = sys.executable, wait: bool = True,
) -> Child:  # fmt: skip
    """`python -m <args>` (a router or worker listening on `port`) from the checkout
    `tree` (a `--before-ref` side), `python` another venv's interpreter (sglang-router),
    ready once its /health answers unless not `wait`: the one way the benchmarks start a
    lone process. Stop it with `Child.stop()`."""
    url = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": str(tree), **(env or {})}
    child = Child(name, args, url, log_dir / f"{name}.log", env, cwd=tree, python=python)
    child.start()
    if wait:
        try:
            wait_health(child, 120)
        except BaseException:
            child.stop(grace_s=1)
            raise
    return child


def sim_worker(port: int, logs: Path, host: str = "127.0.0.1") -> Child:
    """A zero-cost sim worker (prefill and decode cost 0), no Redis, ready."""
    args = ["worker", "serve", "--engine", "sim", "--host", host, "--port", str(port),
            "--worker-id", "bench", "--log-level", "WARNING"]  # fmt: skip
    return serve("worker", args, port, logs)


def serve_router(
    name: str, port: int, logs: Path, flags: list[str], tree: Path = ROOT,
    env: dict[str, str] | None = None, wait: bool = True, log_level: str | None = "WARNING",
) -> Child:  # fmt: skip
    """`router serve` on `port` with `flags`, from the checkout `tree`, logging warnings
    only (`log_level` None: the router's own level, whose lines the e2e tests read)."""
    args = ["router", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    if log_level is not None:
        args += ["--log-level", log_level]
    return serve(name, args, port, logs, tree=tree, env=env, wait=wait)


@dataclass(frozen=True)
class WorkerSpec:
    """Sim worker knobs: decode cost keeps requests in flight long enough to be hit."""

    decode_ms: float = 5.0
    prefill_us: float = 0.0
    cache_tokens: int = 50_000
    heartbeat_s: float = 0.2
    max_running: int = 256
    extra: tuple[str, ...] = ()  # more `worker serve` flags, e.g. ("--log-level", "WARNING")


@dataclass(frozen=True)
class ClusterSpec:
    """A benchmark's cluster: `workers` sim workers with one cost model, logging warnings only."""

    workers: int = 2
    cache_tokens: int = 65_536
    prefill_us_per_token: float = 30.0
    decode_ms_per_token: float = 3.0
    max_running_requests: int = 8
    host_cache_tokens: int = 0  # the host KV tier under each worker's device pool (0: off)
    kv_events: bool = False  # workers publish KV events (a router reads them with kv_events)

    def worker(self) -> WorkerSpec:
        host = (
            ("--host-cache-tokens", str(self.host_cache_tokens)) if self.host_cache_tokens else ()
        )
        events = ("--kv-events",) if self.kv_events else ()
        return WorkerSpec(
            decode_ms=self.decode_ms_per_token, prefill_us=self.prefill_us_per_token,
            cache_tokens=self.cache_tokens, heartbeat_s=0.5,
            max_running=self.max_running_requests,
            extra=("--log-level", "WARNING", *host, *events),
        )  # fmt: skip

    def start(self) -> Cluster:
        return sim_cluster(self.workers, self.worker())


def env_value(value: object) -> str:
    """A RouterConfig value as a RADIX_ROUTER_<KEY> environment value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class Cluster:
    def __init__(
        self, log_dir: Path | None = None, redis: bool = True, redis_password: str | None = None
    ) -> None:
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="radix-cluster-")
        self.log_dir = log_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.redis = RedisServer(password=redis_password).start() if redis else None
        self.workers: dict[str, Child] = {}
        self.router: Child | None = None
        self.router_headers: dict[str, str] = {}
        self.others: list[Child] = []  # more routers, or what a caller adopted

    # -- workers --------------------------------------------------------------------
    def start_worker(
        self, worker_id: str, spec: WorkerSpec = WorkerSpec(), port: int | None = None,
        wait: bool = True, tree: Path | None = None,
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
        # `tree`: the worker's code from that checkout (a `--before-ref` side).
        env = {"PYTHONPATH": str(tree)} if tree is not None else {}
        child = Child(worker_id, args, f"http://127.0.0.1:{port}", log, env, cwd=tree).start()
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

    @property
    def worker_urls(self) -> list[str]:
        return [c.url for c in self.workers.values()]

    def flush(self, only: Sequence[str] | None = None) -> None:
        """Empty every worker's cache, or those of the workers `only` names (call it
        while they are idle)."""
        urls = self.worker_urls if only is None else [self.workers[w].url for w in only]
        for url in urls:
            req = urllib.request.Request(url + "/flush_cache", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status != 200:
                    raise RuntimeError(f"flush_cache on {url} answered {r.status}")

    # -- routers --------------------------------------------------------------------
    def _router(
        self, name: str, settings: dict[str, object] | None, worker_urls: tuple[str, ...],
        tree: Path | None = None,
    ) -> Child:  # fmt: skip
        """Started, not yet waited for. Settings are RouterConfig keys, passed as
        RADIX_ROUTER_<KEY> like a deployment; `tree`: run the router's code from that
        checkout (a `--before-ref` side)."""
        flags = ["--redis-url", self.redis.url] if self.redis is not None else []
        for url in worker_urls:
            flags += ["--worker-url", url]
        base = {"discovery_interval": 0.2, "retry_backoff": 0.01, **(settings or {})}
        env = {f"RADIX_ROUTER_{k.upper()}": env_value(v) for k, v in base.items()}
        return serve_router(
            name, free_port(), self.log_dir, flags, tree or ROOT, env, wait=False, log_level=None
        )

    def start_router(
        self, settings: dict[str, object] | None = None, worker_urls: tuple[str, ...] = (),
        want_workers: int | None = None, headers: dict[str, str] | None = None,
        tree: Path | None = None,
    ) -> Child:  # fmt: skip
        """The cluster's router (a running one is stopped first: a restart with new
        settings, e.g. another policy), ready once it routes to `want_workers` workers
        (default: all of them); from the checkout `tree` where given."""
        if self.router is not None:
            self.router.stop(grace_s=5)
        self.router = self._router("router", settings, worker_urls, tree)
        self.router_headers = headers or {}
        want = len(self.workers) if want_workers is None else want_workers
        wait_until(lambda: self.routable() >= want, START_TIMEOUT_S, self.router)
        return self.router

    def add_router(
        self, name: str, settings: dict[str, object] | None = None, tree: Path | None = None
    ) -> Child:
        """Another router next to the cluster's (a replica), ready once it routes to every
        worker; stopped with the cluster. From the checkout `tree` where given."""
        child = self.adopt(self._router(name, settings, (), tree))
        wait_until(lambda: self.routable(child) >= len(self.workers), START_TIMEOUT_S, child)
        return child

    def start_sglang_router(self, python: str) -> Child:
        """SGLang's Rust router (`sglang-router`, installed in the venv of `python`) as the
        cluster's router, over the workers' URLs (it reads no Redis), its cache_aware policy
        at its defaults: the same thresholds as ours (cache 0.3, balance 64 / 1.5)."""
        if self.router is not None:
            self.router.stop(grace_s=5)
        port = free_port()
        args = [
            "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *self.worker_urls,
        ]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        log = self.log_dir / "sglang-router.log"
        self.router = Child("sglang-router", args, url, log, python=python).start()
        self.router_headers = {}
        wait_until(lambda: procs.answers_health(url), START_TIMEOUT_S, self.router)
        return self.router

    def worker_requests(self) -> dict[str, int]:
        """Requests each worker has answered with 200 so far (its own /metrics)."""
        counts = {}
        for wid, child in self.workers.items():
            with urllib.request.urlopen(child.url + "/metrics", timeout=10) as r:
                lines = r.read().decode().splitlines()
            counts[wid] = int(sum(
                float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith("radix_worker_requests_total{") and 'status="200"' in line
            ))  # fmt: skip
        return counts

    def worker_counter(self, name: str, label: str = "") -> float:
        """A counter summed over every worker's /metrics (samples whose labels hold `label`)."""
        total = 0.0
        for child in self.workers.values():
            with urllib.request.urlopen(child.url + "/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name) and line[len(name)] in " {" and label in line:
                        total += float(line.rsplit(" ", 1)[1])
        return total

    @property
    def router_url(self) -> str:
        assert self.router is not None, "no router started"
        return self.router.url

    def routable(self, router: Child | None = None) -> int:
        """Workers a router would route to now (GET /workers; 0 while it is not up)."""
        router = router or self.router
        assert router is not None
        try:
            status, body = http_json(
                router.url + "/workers", headers=self.router_headers, timeout=2.0
            )
        except OSError:
            return 0
        if status != 200 or not isinstance(body, dict):
            return 0
        return sum(1 for w in body["data"] if w["breaker"] != "open" and not w["draining"])

    def router_workers(self) -> dict[str, dict[str, Any]]:
        _, body = http_json(self.router_url + "/workers", headers=self.router_headers)
        return {w["worker_id"]: w for w in body["data"]}

    def router_metric(self, name: str) -> float:
        """Sum of a Prometheus sample family from the router's /metrics (0 if absent)."""
        req = urllib.request.Request(self.router_url + "/metrics", headers=self.router_headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    # -- the whole cluster ------------------------------------------------------------
    def adopt(self, child: Child) -> Child:
        """A process the caller started, stopped with the cluster."""
        self.others.append(child)
        return child

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

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

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sim_cluster(workers: int, spec: WorkerSpec | None = None) -> Cluster:
    """Redis + `workers` sim workers named w0..w{n-1}, started together, all healthy."""
    cluster = Cluster()
    try:
        for i in range(workers):
            cluster.start_worker(f"w{i}", spec or WorkerSpec(), wait=False)
        for child in cluster.workers.values():
            wait_health(child)
    except BaseException:
        cluster.close()
        raise
    return cluster
