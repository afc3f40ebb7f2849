"""Serve an aiohttp app from a thread of its own, for tests whose code under test
blocks (a subprocess run, a synchronous client) while the app answers it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from aiohttp import web

from shared.procs import free_port


@contextlib.contextmanager
def serve_in_thread(app: web.Application) -> Iterator[str]:
    """Yield the URL of `app` on a free loopback port; stop it and its loop on exit."""
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
