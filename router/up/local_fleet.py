"""`radix-router up`: a whole local fleet (Redis, N workers, the router) as child processes.

Each worker and the router run in their own session (process group), so stopping
kills whatever they spawned too: SIGTERM to every group (the router first, so it
drains while workers still answer), a grace period, then SIGKILL. Redis is stopped
last. Ctrl-C (SIGINT) and SIGTERM both lead there, also in the middle of starting.
While it runs, `up` supervises everything it started (router/up/watch.py): a worker,
the router or the embedded Redis that exits is reported in one line, saying what still
serves, and restarted on its port after a backoff; only a process that keeps exiting
(router/up/restarts.py: more than 5 exits within 120 s) stops the fleet (exit 1).
Child output (Redis's too) goes to log files in a temporary folder, so the terminal
shows only progress; the folder is removed on a clean exit unless `keep_logs`. When the
fleet fails (a start that fails, a process that keeps exiting) the folder is kept and
its path printed, after the failing process's last lines: the record of why it died.
Before anything starts, router/up/preflight.py checks the router's port, what the
children will need, and that a `--redis-url` answers (named within seconds, not after
the start timeout).

The router never imports `worker`: workers are `python -m worker serve ...` and the
tiny model is built by `python -m worker make-tiny-model DIR`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from router.up.preflight import StartError, check_port, check_prerequisites, check_redis
from router.up.restarts import Restarts
from router.up.watch import GIVE_UP_LINES, Watch
from shared.procs import Child, free_port, http_json, last_lines, wait_health
from shared.redis_server import RedisServer

STOP_GRACE_S = 10.0
RADIX_DEMO_CACHE_TOKENS = 32768


@dataclass(frozen=True)
class UpOptions:
    workers: int = 2
    # radix by default: the real engine on the tiny model, so `up` serves the model name
    # the README's snippets use (`tiny-model`); `sim` needs no torch.
    engine: str = "radix"
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
    keep_logs: bool = False
    # Workers publish KV events and the router indexes them with the workers' tokenizer.
    kv_events: bool = True


class UpFleet:
    def __init__(self, options: UpOptions, out: TextIO = sys.stdout) -> None:
        self.options = options
        self.out = out
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.log_dir: Path | None = None
        self._stop = threading.Event()
        self._launched: dict[str, float] = {}  # child name -> when it was started
        self.restarts = Restarts()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop.set()

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            check_prerequisites(self.options.engine, self.options.redis_url)
            check_port(self.options.host, self.options.port)
            if self.options.redis_url:
                check_redis(self.options.redis_url)
            self.log_dir = Path(tempfile.mkdtemp(prefix="radix-up-"))
            self.start()
            self.say("Press Ctrl-C to stop.")
            code = self._watch()
        except StartError as e:
            self.say(f"error: {e}")
            code = 1
        finally:
            self.stop()
            self._tidy_logs(failed=code != 0 and not self._stop.is_set())  # not a Ctrl-C
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def _tidy_logs(self, failed: bool) -> None:
        if self.log_dir is None:
            return
        if failed:
            self.say(f"logs kept in {self.log_dir} (the fleet failed: they say why)")
        elif self.options.keep_logs:
            self.say(f"logs kept in {self.log_dir}")
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- starting -------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        total = o.workers + 2
        if o.redis_url:
            redis_url = o.redis_url
            self.say(f"[1/{total}] using Redis at {redis_url}")
        else:
            assert self.log_dir is not None
            self.redis = RedisServer(log_file=self.log_dir / "redis.log").start()
            redis_url = self.redis.url
            self.say(
                f"[1/{total}] Redis-protocol server on {redis_url} ({Path(self.redis.binary).name})"
            )
        model = self._model_path()
        # The radix worker sizes its KV pool from free memory by default; on a laptop
        # CPU that is gigabytes for a demo, so `up` asks for a small pool unless told.
        cache_tokens = o.cache_tokens or (RADIX_DEMO_CACHE_TOKENS if o.engine == "radix" else None)
        self.say(
            f"      logs in {self.log_dir}" + ("" if o.keep_logs else " (removed on a clean exit)")
        )
        # Workers start together and are waited for after: each spends its start loading
        # torch and the model, so N of them take about as long as one, not N times as long.
        workers = []
        for i in range(o.workers):
            port = free_port()
            args = ["serve", "--engine", o.engine, "--host", o.host, "--port", str(port),
                    "--redis-url", redis_url, "--worker-id", f"worker-{i}"]  # fmt: skip
            if model:
                args += ["--model", model]
            if o.kv_events:
                args += ["--kv-events"]
            for flag, value in (("--cache-tokens", cache_tokens),
                                ("--max-running-requests", o.max_running_requests),
                                ("--sim-prefill-us-per-token", o.sim_prefill_us_per_token),
                                ("--sim-decode-ms-per-token", o.sim_decode_ms_per_token)):  # fmt: skip
                if value is not None:
                    args += [flag, str(value)]
            url = f"http://{o.host}:{port}"
            workers.append(self._launch(f"worker-{i}", "worker", args, url, f"[{i + 2}/{total}]"))
        for worker in workers:
            self._await(worker)
        port = o.port or free_port()
        args = ["serve", "--host", o.host, "--port", str(port), "--redis-url", redis_url,
                "--policy", o.policy]  # fmt: skip
        # The default imbalance gap (64 requests) suits GPU workers running hundreds at
        # once; a local fleet never reaches it, and a prompt every request shares would
        # pull all traffic to one worker. Half a worker's batch is the scale that works
        # (loadtests/results/policies.md).
        env = {"RADIX_ROUTER_BALANCE_ABS_THRESHOLD": str(max(1, o.max_running_requests // 2))}
        if o.kv_events:  # the exact index beside the tree, on the workers' own tokens
            env |= {"RADIX_ROUTER_KV_EVENTS": "true", "RADIX_ROUTER_TOKENIZER": model or "sim"}
        router = self._launch(
            "router", "router", args, f"http://{o.host}:{port}", f"[{total}/{total}]", env=env
        )
        self._await(router)
        self._banner(router.url)

    def _banner(self, url: str) -> None:
        o = self.options
        try:
            models = http_json(url + "/v1/models", timeout=5.0)[1]["data"]
            model = models[0]["id"]
        except (OSError, LookupError, TypeError):
            model = "?"
        if o.engine == "sim":
            note = "the sim engine runs no model: replies are filler text, timed by a cost model"
        elif o.model:
            note = f"serving {o.model}"
        else:
            note = "the tiny model has random weights: its replies are random text (the caching is real)"
        self.say("")
        self.say(f"Router ready at {url}  ({o.workers} {o.engine} workers, policy {o.policy})")
        self.say(f"  model:     {model}  (the name to put in requests)")
        self.say(f"  note:      {note}")
        self.say(f"  dashboard: {url}/dashboard")
        self.say("First request:")
        self.say(f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\")
        self.say(f'    -d \'{{"model": "{model}", "prompt": "Hello, radix!", "max_tokens": 16}}\'')
        self.say(f"  python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='x'); "
                 f"print(c.completions.create(model='{model}', prompt='Hi', max_tokens=8))\"")  # fmt: skip

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

    def _launch(
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
        assert self.log_dir is not None
        child = Child(name, [module, *args], url, self.log_dir / f"{name}.log", env or {}).start()
        self.children.append(child)
        self.say(f"{step} {name} (pid {child.pid}) starting on {url} ...")
        self._launched[name] = time.monotonic()
        return child

    def _await(self, child: Child) -> None:
        name, timeout = child.name, self.options.start_timeout
        try:
            wait_health(child, timeout, poll_s=0.2, stop=self._stop)
        except InterruptedError as e:
            raise StartError("interrupted") from e
        except RuntimeError as e:
            raise StartError(f"{name} exited with {child.returncode}; {self._last(child)}") from e
        except TimeoutError as e:
            raise StartError(f"{name} not healthy within {timeout}s; {self._last(child)}") from e
        self.say(f"      {name} ready in {time.monotonic() - self._launched[name]:.1f}s")

    @staticmethod
    def _last(child: Child) -> str:
        """The child's last log lines, each whole, for a failed start."""
        lines = last_lines(child.log, GIVE_UP_LINES)
        return f"last lines of {child.log}:\n" + "\n".join(f"  {ln}" for ln in lines)

    # -- running and stopping ---------------------------------------------------------
    def _watch(self) -> int:
        """Serve until Ctrl-C/SIGTERM (0); 1 when a process keeps exiting (watch.py)."""
        watch = Watch(self.children, self.redis, self.restarts, self.say, self._stop,
                      self._launched)  # fmt: skip
        return watch.run()

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
