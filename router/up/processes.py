"""`radix-router serve --processes N`: N router processes on one host behind one port.

One Python process routes about as many requests as one core runs its event loop
(loadtests/results/router_overhead.md), so a router scales with cores by running one
process per core. Each process binds the same host:port with SO_REUSEPORT and the
kernel spreads incoming connections over them (by a hash of each connection's
addresses: a keep-alive connection stays with one process).

The processes route as replicas of one router. With `redis_url` set, replica sync
(router/holdings/sync.py) is turned on, so each applies the others' routing decisions to its
trees (within `sync_flush_interval`) and counts their requests in flight in its loads,
exactly as router replicas on different hosts do. Without Redis each process routes on
what it alone has seen; a warning says so.

The parent only supervises. It starts the children with multiprocessing's `spawn`
(fresh interpreters: nothing of an event loop is forked), passes SIGTERM/SIGINT on so
each drains its own requests, restarts a child that exits on its own, and gives up
(stopping the rest, exit status 1) when children keep dying within seconds of starting,
or at once when one cannot bind the port (taken by another program).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from shared.config import ConfigError, RouterConfig
from shared.serving.logging import setup_logging

log = logging.getLogger(__name__)

QUICK_EXIT_S = 5.0  # a child that exits sooner than this after its start failed to start
MAX_QUICK_EXITS = 3
POLL_S = 0.5
STOP_MARGIN_S = 5.0  # beyond a child's own stop (shutdown_delay + drain_timeout)
CANNOT_LISTEN = 3  # a child's exit status when its port is taken: the parent gives up


def child_config(config: RouterConfig) -> RouterConfig:
    """What each process runs: the same config, with replica sync on when it can be."""
    if config.port == 0:
        raise ConfigError("processes: more than 1 needs a fixed port (the processes share it)")
    if config.redis_url and not config.sync:
        return config.model_copy(update={"sync": True})
    return config


RunRouter = Callable[[RouterConfig], int]  # one router process's body (picklable: spawn)


def _child(run_router: RunRouter, config: RouterConfig) -> None:
    """A child's body: `run_router`, its 1 (it could not listen: the port taken by another
    program) turned into CANNOT_LISTEN. That is no crash a restart cures, and a child
    slow to start (imports, the first registry read) did not count as a quick exit: it
    was restarted forever."""
    sys.exit(CANNOT_LISTEN if run_router(config) == 1 else 0)


class Supervisor:
    def __init__(self, config: RouterConfig, run_router: RunRouter) -> None:
        self.config = child_config(config)
        self._run_router = run_router
        self._ctx = multiprocessing.get_context("spawn")
        self._children: list[tuple[BaseProcess, float]] = []  # (process, started at)
        self._stop = threading.Event()
        self._quick_exits = 0

    def _start(self) -> tuple[BaseProcess, float]:
        proc = self._ctx.Process(
            target=_child, args=(self._run_router, self.config), name="radix-router"
        )
        proc.start()
        return proc, time.monotonic()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        n = self.config.processes
        if not self.config.redis_url:
            log.warning("%d router processes without redis_url: each routes on its own trees", n)
        self._children = [self._start() for _ in range(n)]
        log.info(
            "%d router processes on http://%s:%s (pids %s)", n, self.config.host,
            self.config.port, ", ".join(str(p.pid) for p, _ in self._children),
        )  # fmt: skip
        failed = False
        while not self._stop.wait(POLL_S):
            failed = self._restart_dead()
            if failed:
                break
        self._stop_all()
        return 1 if failed else 0

    def _restart_dead(self) -> bool:
        """Restart children that exited; True when they keep failing to start."""
        for i, (proc, started) in enumerate(self._children):
            if proc.is_alive() or self._stop.is_set():
                continue
            if proc.exitcode == CANNOT_LISTEN:
                log.error("router processes cannot listen (see above); stopping")
                return True
            quick = time.monotonic() - started < QUICK_EXIT_S
            self._quick_exits = self._quick_exits + 1 if quick else 0
            if self._quick_exits >= MAX_QUICK_EXITS:
                log.error(
                    "router processes keep exiting at start (last: %s); stopping", proc.exitcode
                )
                return True
            log.warning("router process %s exited (%s); restarting it", proc.pid, proc.exitcode)
            self._children[i] = self._start()
        return False

    def _stop_all(self) -> None:
        for proc, _ in self._children:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)  # each drains its own requests
        config = self.config
        deadline = time.monotonic() + STOP_MARGIN_S + config.shutdown_delay + config.drain_timeout
        for proc, _ in self._children:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("router process %s did not stop in time; killed", proc.pid)
                proc.kill()
                proc.join()


def run_processes(config: RouterConfig, run_router: RunRouter) -> int:
    """Supervise `config.processes` router processes, each running `run_router` (the
    cli's: this module knows no router code), until SIGTERM/SIGINT."""
    setup_logging(config.log_level)
    supervisor = Supervisor(config, run_router)
    previous = {
        sig: signal.signal(sig, supervisor.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
