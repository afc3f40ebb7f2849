"""The worker process's life on its event loop (`radix-worker serve`).

Build the engine off the loop (blocking setup: tokenizers, vLLM args; weights load in
`engine.start()`), bind, serve until SIGTERM or Ctrl-C, then leave the fleet, keep
serving `shutdown_delay` seconds (routers drop the worker within a discovery interval and
until then still send to it), stop taking requests and finish in-flight ones within
`drain_timeout`. Returns the exit status: 0 a clean stop, 1 the engine or the port
failed (one log line). A `ConfigError` from the builder propagates: the CLI exits 2.

The builder is passed in (`worker/cli.py` hands `worker.backends.build_engine`): this
room serves whatever `Engine` it is given.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

from aiohttp import web

from shared.config import ConfigError, WorkerConfig
from shared.serving.http_server import KEEPALIVE_S, BindError, bind
from worker.engine.types import Engine
from worker.http.app import create_app
from worker.http.state import HEARTBEAT, STATE

log = logging.getLogger("worker")

EngineBuilder = Callable[[WorkerConfig], Engine]


def run(config: WorkerConfig, build: EngineBuilder) -> int:
    """`serve` on a fresh event loop: uvloop's when it is installed."""
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(config, build))


def _url_host(host: str) -> str:
    # A wildcard bind is not dialable; the hostname is (pods, compose services).
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def serve(config: WorkerConfig, build: EngineBuilder) -> int:
    try:
        engine = await asyncio.to_thread(build, config)
    except ConfigError:
        raise  # a key that names what is wrong: exit 2 (worker/cli.py)
    except ValueError as e:  # a size the host cannot hold (worker/engine/free_memory.py)
        log.error("engine cannot start: %s", e)
        return 1
    app = create_app(config, engine)
    state = app[STATE]
    # handler_cancellation: a client that hangs up cancels its handler, which aborts
    # its engine request (non-streaming requests otherwise notice only when answering).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=KEEPALIVE_S)  # fmt: skip
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:  # a port that is taken: one line and exit 1, the engine and runner stopped
            await bind(runner, config.host, config.port,
                       header_read_timeout=config.header_read_timeout)  # fmt: skip
        except BindError as e:
            log.error("%s", e)
            return 1
        port = runner.addresses[0][1]
        if state.url is None:
            state.url = f"http://{_url_host(config.host)}:{port}"
        waiters = [asyncio.ensure_future(state.booted.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if state.failure is not None:
            log.error("engine failed to start: %s", state.failure)
            return 1
        if state.ready.is_set():
            log.info(
                "serving %s on http://%s:%d (engine=%s)",
                state.served_model, config.host, port, config.engine,
            )  # fmt: skip
        await stop.wait()
        # Deregister first, then drain: see the module docstring.
        log.info("shutting down: leaving the fleet, then draining %d in flight", state.inflight)
        heartbeat = app.get(HEARTBEAT)
        if heartbeat is not None:
            await heartbeat.leave()
        if config.shutdown_delay > 0:
            await asyncio.sleep(config.shutdown_delay)
        state.draining = True
        try:
            await asyncio.wait_for(state.idle.wait(), config.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout: %d requests still in flight are cut", state.inflight)
        return 0
    finally:
        await runner.cleanup()
