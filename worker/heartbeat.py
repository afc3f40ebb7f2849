"""The worker's heartbeat: its record in Redis every `heartbeat_interval`.

Written through `shared.wire.registry.Registry` (the only code that knows key names), with
an expiry of `heartbeat_ttl_intervals` intervals, so a worker that dies without a word
(SIGKILL, node loss) drops out of every router within a few seconds.

Redis is soft state: when it is unreachable the worker keeps serving, logs once per
outage, and retries every interval; redis-py reconnects by itself, and the first
beat after an outage publishes `join` again so routers that restarted meanwhile hear
of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from shared.config import read_password_file
from shared.serving.aio import reraise_if_cancelled, stop_task
from shared.wire.registry import Registry, WorkerRecord

log = logging.getLogger(__name__)

_FAILURES = (RedisError, OSError, asyncio.TimeoutError)


def connect(url: str, interval: float, password_file: str | None = None) -> Redis:
    """A client that fails fast: a beat must never block longer than about an interval.
    With `password_file`, the password comes from that file (the URL names the user)."""
    timeout = max(0.2, interval)
    extra = {} if password_file is None else {"password": read_password_file(password_file)}
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        **extra,
    )


class Heartbeat:
    def __init__(
        self,
        registry: Registry,
        record: Callable[[], WorkerRecord],
        interval: float,
        ttl_intervals: int,
    ) -> None:
        self.registry = registry
        # Where the heartbeats go, for the log (no password: host, port and db only).
        kw = registry.redis.connection_pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"
        self.record = record
        self.interval = interval
        self.ttl = interval * ttl_intervals
        self.beats = 0  # successful writes (tests wait on this)
        self.failures = 0  # failed writes (Redis unreachable)
        self.joined = False
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._left = False
        self._stopping = False  # checked by the loop: a cancel alone can be lost (stop_task)

    def start(self, ready: asyncio.Event) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(ready), name="heartbeat")

    async def _run(self, ready: asyncio.Event) -> None:
        await ready.wait()  # routers must not see a worker whose engine is not up
        while not self._stopping:
            await self.beat()
            await asyncio.sleep(self.interval)

    async def beat(self) -> bool:
        """One write; False (logged, not raised) when Redis is unreachable."""
        try:
            await self.registry.publish_heartbeat(self.record(), self.ttl, joined=not self.joined)
        except _FAILURES as exc:
            reraise_if_cancelled()
            self.failures += 1
            if not self._failing:
                log.warning(
                    "heartbeat to Redis failed at %s (%s: %s); still serving, retrying",
                    self.where, type(exc).__name__, exc,
                )  # fmt: skip
            self._failing = True
            self.joined = False
            return False
        if self._failing:
            log.info("Redis reachable again; heartbeats resumed")
        self._failing = False
        self.joined = True
        self.beats += 1
        return True

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            await stop_task(task)

    async def leave(self) -> None:
        """Stop beating, then delete the record and publish `leave` (once)."""
        await self.stop()
        if self._left:
            return
        self._left = True
        try:
            await self.registry.leave(self.record())
            log.info("left the fleet")
        except _FAILURES as exc:
            log.warning("could not leave the fleet in Redis (%s); the record expires", exc)
