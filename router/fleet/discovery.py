"""Worker discovery from the Redis registry.

A full read of the registry (`Registry.read_fleet`) every `discovery_interval` is the
source of truth; join/leave events on the pub/sub channel only wake the poller early,
so a lost event costs at most one interval. While Redis is unreachable the fleet is
left as it was (routing goes on with the last known workers) and the poller retries
with exponential backoff. After Redis comes back it may be empty until every worker
has sent its next heartbeat, so for `reconnect_grace` seconds after an outage (a failed
poll, or the event subscription broken: a restart can fall between two polls) a
registry worker is not dropped for being absent (its breaker still guards it).

Any worker may publish on the events channel, and a poll reads every worker's hash, so
events wake the poller at most once per `MIN_WAKE_GAP_S`: a worker flooding the channel
buys at most that many polls, not one per message.

Reachability is a state the router reports, not only a log line: `unreachable_since`
(wall-clock time of the first failed read in a row, None while reachable) feeds
`/readiness` (still 200: the last known fleet serves), a gauge in `/metrics` and a banner
on the dashboard. The first failure is logged at once, naming the URL (password
redacted) and the error, and again once a minute while it lasts (`WARN_EVERY_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.fleet.workers import Worker
from shared.serving.aio import reraise_if_cancelled, stop_task
from shared.wire.peers import Network, Rejections, check_worker_url
from shared.wire.registry import Registry, WorkerRecord, redact_url

log = logging.getLogger(__name__)


class RegistryFleet(Protocol):
    """What discovery reads and tells of the worker table (`router.fleet.table.Fleet`)."""

    @property
    def workers(self) -> Mapping[str, Worker]: ...

    def apply_registry(
        self, records: dict[str, WorkerRecord], drop_missing: bool = True, now: float = 0.0
    ) -> tuple[list[str], list[str]]: ...


MAX_BACKOFF_S = 5.0
MIN_WAKE_GAP_S = 0.1
WARN_EVERY_S = 60.0


class Discovery:
    def __init__(
        self,
        registry: Registry,
        fleet: RegistryFleet,
        interval: float,
        reconnect_grace: float,
        clock: Callable[[], float] = time.monotonic,
        allow: tuple[Network, ...] = (),
        url: str = "",
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.url = redact_url(url)  # for the log lines; never the password
        self.wall = wall
        self.fleet = fleet
        self.allow = allow  # worker_url_allow_cidrs
        self.interval = interval
        self.reconnect_grace = reconnect_grace
        self.clock = clock
        self.connected = False
        self.polls = 0
        self.errors = 0
        self._wake = asyncio.Event()
        self.first_poll = asyncio.Event()  # set once the first read of the registry ended
        self._grace_until = 0.0
        self.stopping = False  # set by the owner before it cancels run(); see stop_task
        self.unreachable_since: float | None = None  # wall-clock time of the first failure
        self.last_error = ""
        self._warned_at = 0.0  # clock() of the last "still unreachable" warning

    @classmethod
    def from_url(
        cls, url: str, prefix: str, fleet: RegistryFleet, interval: float, grace: float,
        clock: Callable[[], float] = time.monotonic, rejections: Rejections | None = None,
        allow: tuple[Network, ...] = (),
    ) -> Discovery:  # fmt: skip
        # Short socket timeouts: a dead Redis must not stall a poll for long.
        timeout = max(1.0, 2 * interval)
        redis = Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        registry = Registry(redis, prefix, rejections)
        return cls(registry, fleet, interval, grace, clock, allow=allow, url=url)

    def _allowed(self, records: dict[str, WorkerRecord]) -> dict[str, WorkerRecord]:
        """Records the registry may apply: not claiming the id of a worker configured by
        hand (a record naming a static worker's `host:port` took over its URL, so a
        Redis writer redirected the operator's own worker), and with their URL in
        `worker_url_allow_cidrs` (the registry checked the rest)."""
        kept = {}
        for wid, record in records.items():
            worker = self.fleet.workers.get(wid)
            try:
                if worker is not None and worker.source != "redis":
                    raise ValueError(f"the id of a worker added by hand ({worker.source})")
                if self.allow:
                    check_worker_url(record.url, self.allow)
            except ValueError as e:
                self.registry.rejections.reject("registry", wid, str(e))
                continue
            kept[wid] = record
        return kept

    async def poll_once(self) -> None:
        records = self._allowed(
            await asyncio.wait_for(self.registry.read_fleet(), timeout=max(1.0, 2 * self.interval))
        )
        # Right after an outage the registry may not hold every worker again yet.
        now = self.clock()
        drop = now >= self._grace_until
        joined, left = self.fleet.apply_registry(records, drop_missing=drop, now=now)
        if joined or left:
            log.info("fleet changed: joined %s, left %s", joined, left)

    async def run(self) -> None:
        """Poll forever (cancel to stop), with the event listener alongside."""
        listener = asyncio.create_task(self._listen())
        backoff = self.interval
        try:
            while not self.stopping:
                try:
                    await self.poll_once()
                    self.polls += 1
                    self._reachable()
                    self.first_poll.set()
                    backoff = self.interval
                    polled_at = time.monotonic()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.interval)
                    gap = min(self.interval, MIN_WAKE_GAP_S)
                    await asyncio.sleep(max(0.0, polled_at + gap - time.monotonic()))
                except (RedisError, OSError, TimeoutError) as e:
                    reraise_if_cancelled()
                    self.first_poll.set()  # unreachable: routing goes on without it
                    self.errors += 1
                    self._unreachable(e)
                    self._grace_until = self.clock() + self.reconnect_grace
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
        finally:
            await stop_task(listener, timeout=2.0)
            await self.registry.redis.aclose()

    @property
    def state(self) -> str:
        """`reachable`, `unreachable since <ISO time>` or `connecting` (no read ended yet)."""
        if self.unreachable_since is not None:
            return f"unreachable since {iso(self.unreachable_since)}"
        return "reachable" if self.connected else "connecting"

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.info(
                "registry reachable again at %s (unreachable since %s); workers re-register "
                "within a heartbeat", self.url, iso(self.unreachable_since),
            )  # fmt: skip
        elif not self.connected:
            log.info("registry reachable at %s", self.url)
        self.connected = True
        self.unreachable_since = None
        self.last_error = ""

    def _unreachable(self, error: BaseException) -> None:
        """Say so at once (the URL and the error), then once a minute while it lasts."""
        self.connected = False
        self.last_error = f"{type(error).__name__}: {error or 'no answer in time'}"
        now = self.clock()
        if self.unreachable_since is None:
            self.unreachable_since = self.wall()
            self._warned_at = now
            log.error(
                "registry unreachable at %s (%s); routing on the last known fleet (%d workers)",
                self.url, self.last_error, len(self.fleet.workers),
            )  # fmt: skip
        elif now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "registry still unreachable at %s since %s (%s); routing on the last known "
                "fleet (%d workers)", self.url, iso(self.unreachable_since), self.last_error,
                len(self.fleet.workers),
            )  # fmt: skip

    async def _listen(self) -> None:
        """Wake the poller on join/leave events; reconnect with backoff when Redis drops."""
        backoff = self.interval
        while not self.stopping:
            pubsub = self.registry.redis.pubsub()
            try:
                await pubsub.subscribe(self.registry.events_channel)
                backoff = self.interval
                while not self.stopping:
                    msg = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.interval
                    )
                    if msg is not None:
                        self._wake.set()
            except (RedisError, OSError, TimeoutError):
                reraise_if_cancelled()
                # The subscription broke: Redis may come back empty before the next poll
                # fails (a restart between two polls), so absent workers get the grace too.
                self._grace_until = self.clock() + self.reconnect_grace
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


def iso(wall: float) -> str:
    """`2026-12-06T05:10:00Z`: a wall-clock time for people and their tools."""
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
