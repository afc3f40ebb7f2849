"""`radix-router up`: a whole local fleet (Redis, N workers, the router) as child processes.

Each worker and the router run in their own session (process group), so stopping
kills whatever they spawned too: SIGTERM to every group (the router first, so it
drains while workers still answer), a grace period, then SIGKILL. Redis is stopped
last. Ctrl-C (SIGINT) and SIGTERM both lead there, also in the middle of starting.
Child output goes to log files, named on screen, so the terminal shows only progress.

The router never imports `worker`: workers are `python -m worker serve ...` and the
tiny model is built by `python -m worker make-tiny-model DIR`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from shared.procs import Child, free_port, wait_health
from shared.redis_server import RedisServer

STOP_GRACE_S = 10.0
RADIX_DEMO_CACHE_TOKENS = 32768


@dataclass(frozen=True)
class UpOptions:
    workers: int = 2
    engine: str = "sim"
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    policy: str = "cache_aware"
    cache_tokens: int | None = None
    max_running_requests: int = 16
    sim_prefill_us_per_token: float | None = None
    sim_decode_ms_per_token: float | None = None
    model_cache_dir: str | None = None
    start_timeout: float = 120.0


class StartError(RuntimeError):
    pass


class LocalFleet:
    def __init__(self, options: UpOptions, out: TextIO = sys.stdout) -> None:
        self.options = options
        self.out = out
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="radix-up-"))
        self._stop = threading.Event()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop.set()

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            self.start()
            self.say("Press Ctrl-C to stop.")
            code = self._watch()
        except StartError as e:
            self.say(f"error: {e}")
            code = 1
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    # -- starting -------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        total = o.workers + 2
        if o.redis_url:
            redis_url = o.redis_url
            self.say(f"[1/{total}] using Redis at {redis_url}")
        else:
            self.redis = RedisServer().start()
            redis_url = self.redis.url
            self.say(
                f"[1/{total}] Redis-protocol server on {redis_url} ({Path(self.redis.binary).name})"
            )
        model = self._model_path()
        # The radix worker sizes its KV pool from free memory by default; on a laptop
        # CPU that is gigabytes for a demo, so `up` asks for a small pool unless told.
        cache_tokens = o.cache_tokens or (RADIX_DEMO_CACHE_TOKENS if o.engine == "radix" else None)
        self.say(f"      logs in {self.log_dir}")
        for i in range(o.workers):
            port = free_port()
            args = ["serve", "--engine", o.engine, "--host", o.host, "--port", str(port),
                    "--redis-url", redis_url, "--worker-id", f"worker-{i}"]  # fmt: skip
            if model:
                args += ["--model", model]
            for flag, value in (("--cache-tokens", cache_tokens),
                                ("--max-running-requests", o.max_running_requests),
                                ("--sim-prefill-us-per-token", o.sim_prefill_us_per_token),
                                ("--sim-decode-ms-per-token", o.sim_decode_ms_per_token)):  # fmt: skip
                if value is not None:
                    args += [flag, str(value)]
            self._spawn(
                f"worker-{i}", "worker", args, f"http://{o.host}:{port}", f"[{i + 2}/{total}]"
            )
        port = o.port or free_port()
        args = [
            "serve",
            "--host",
            o.host,
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--policy",
            o.policy,
        ]
        # The default imbalance gap (64 requests) suits GPU workers running hundreds at
        # once; a local fleet never reaches it, and a prompt every request shares would
        # pull all traffic to one worker. Half a worker's batch is the scale that works
        # (loadtests/results/policies.md).
        env = {"RADIX_ROUTER_BALANCE_ABS_THRESHOLD": str(max(1, o.max_running_requests // 2))}
        router = self._spawn(
            "router", "router", args, f"http://{o.host}:{port}", f"[{total}/{total}]", env=env
        )
        self.say("")
        self.say(f"Router ready at {router.url}")
        self.say(f"  curl {router.url}/v1/completions -H 'Content-Type: application/json' \\")
        self.say('    -d \'{"prompt": "Hello, radix!", "max_tokens": 16}\'')
        self.say(f"  python -c \"import openai; c = openai.OpenAI(base_url='{router.url}/v1', api_key='x'); "
                 "print(c.completions.create(model=c.models.list().data[0].id, prompt='Hi', max_tokens=8))\"")  # fmt: skip

    def _model_path(self) -> str | None:
        o = self.options
        if o.engine != "radix" or o.model:
            return o.model
        cache = Path(o.model_cache_dir or Path.home() / ".cache" / "radix-router" / "tiny-model")
        if not (cache / "config.json").exists():
            self.say(f"      building the tiny model in {cache} ...")
            cmd = [sys.executable, "-m", "worker", "make-tiny-model", str(cache)]
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.options.start_timeout
            )
            if done.returncode != 0:
                raise StartError(f"make-tiny-model failed: {done.stderr[-2000:]}")
        return str(cache)

    def _spawn(
        self,
        name: str,
        module: str,
        args: list[str],
        url: str,
        step: str,
        env: dict[str, str] | None = None,
    ) -> Child:
        if self._stop.is_set():
            raise StartError("interrupted")
        # Own session (shared.procs.Child): the group can be signalled as one, and a
        # terminal Ctrl-C reaches only `up`, which then stops children in order.
        child = Child(name, [module, *args], url, self.log_dir / f"{name}.log", env or {}).start()
        self.children.append(child)
        self.say(f"{step} {name} (pid {child.pid}) starting on {url} ...")
        started = time.monotonic()
        timeout = self.options.start_timeout
        try:
            wait_health(child, timeout, poll_s=0.2, stop=self._stop)
        except InterruptedError as e:
            raise StartError("interrupted") from e
        except RuntimeError as e:
            raise StartError(f"{name} exited with {child.returncode}:\n{child.tail(2000)}") from e
        except TimeoutError as e:
            raise StartError(f"{name} not healthy within {timeout}s:\n{child.tail(2000)}") from e
        self.say(f"      {name} ready in {time.monotonic() - started:.1f}s")
        return child

    # -- running and stopping ---------------------------------------------------------
    def _watch(self) -> int:
        while not self._stop.wait(0.5):
            for child in self.children:
                if not child.alive:
                    self.say(
                        f"{child.name} exited unexpectedly ({child.returncode}):\n{child.tail(2000)}"
                    )
                    return 1
        self.say("stopping ...")
        return 0

    def stop(self) -> None:
        # The router first, so it stops taking work while the workers can still finish.
        for group in (
            [c for c in self.children if c.name == "router"],
            [c for c in self.children if c.name != "router"],
        ):
            for child in group:  # all of a group at once, so their grace periods overlap
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                # Waits out what is left of the grace, then kills whatever is left in the
                # group (the child or anything it spawned).
                child.stop(grace_s=deadline - time.monotonic())
        self.children.clear()
        if self.redis is not None:
            self.redis.close()
            self.redis = None
