"""Reading the workers' KV-event streams from Redis for the feed (router/holdings/kv_feed.py):
every router replica reads every followed worker's stream itself (XREAD-like, no
consumer group), and each entry is applied in steps (router/holdings/feed_entries.py).

Bounds against a worker's credential (issue 30: one worker's stream stalled every router):
- Sizes are checked in Redis before a read (shared/wire/registry.py `read_kv_events`): an
  entry over MAX_ENTRY_BYTES never crosses the wire, and the reader trims the stream past
  it (measured once, its memory back to Redis). Routers trim every followed stream to
  `stream_len` entries (a worker's own MAXLEN is not trusted).
- Entries are applied with a time budget: past `apply_budget` seconds of the event loop
  the reader yields, so `/health` and routing run between the entries' steps.
- Each worker's stream takes at most CPU_SHARE of the event loop (a credit refilled over
  time, CPU_BURST_S at once); past it its entries wait in Redis and it is `lagging`.
- A full read means more is waiting: a reader more than `max_lag` behind a busy stream
  leaves it `lagging` (applied, not trusted) until a read comes back short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from redis.exceptions import RedisError

from router.holdings.feed_streams import FeedMember, StreamState
from shared.serving.aio import reraise_if_cancelled
from shared.wire.registry import Registry

log = logging.getLogger(__name__)

APPLY_BUDGET_S = 0.005  # event-loop time spent applying entries before yielding once
POLL_S = 0.05  # between reads of idle streams (a sized read cannot block in Redis)
READ_GAP_S = 0.2  # between reads that find entries, while routes ask (`run`)
TRIM_EVERY_S = 1.0  # between the router's trims of the followed streams (cheap: MAXLEN ~)
# Event-loop time one worker's stream may take: 0.1 s a second, 0.5 s at once. Honest
# workers need far less (kv_events.md: ~0.3 ms per routed request's events); past it the
# stream waits (unread, nothing lost) and the worker is `lagging` (routed on its tree).
CPU_SHARE = 0.1
CPU_BURST_S = 0.5


_NEVER = float("inf")


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class ReadFeed(Protocol):
    """What the reader reads of the feed (router/holdings/kv_feed.py's KvEventFeed)."""

    streams: dict[str, StreamState]
    indexes: Mapping[str, object]
    drops: Sequence[object]  # blocks being dropped, in steps (`settle_drops`)

    def follow(self, members: Iterable[FeedMember]) -> None: ...
    def settle_drops(self) -> Iterator[None]: ...
    def raw_steps(self, wid: str, fields: dict[bytes, bytes]) -> Iterator[None]: ...


class FeedReader:
    """Reads the feed's streams after their cursors and applies what it reads."""

    def __init__(
        self,
        feed: ReadFeed,
        registry: Registry,
        read_count: int = 256,
        max_lag: float = 2.0,
        clock: Callable[[], float] = time.time,
        stream_len: int = 10_000,
        apply_budget: float = APPLY_BUDGET_S,
        cpu_share: float = CPU_SHARE,
        cpu_burst: float = CPU_BURST_S,
    ) -> None:
        self.feed = feed
        self.registry = registry
        self.read_count = read_count
        self.max_lag = max_lag
        self.clock = clock  # wall time: stream entry ids are milliseconds of it
        self.stream_len = stream_len
        self.apply_budget = apply_budget
        self.cpu_share, self.cpu_burst = cpu_share, cpu_burst
        self.throttled = 0  # reads a worker's stream waited for its CPU share
        self.failures = 0  # reads that failed (Redis unreachable, ...)
        self.stopping = False  # set by the owner before it cancels `run` (aio.py `stop_task`)
        self._trimmed = 0.0
        self._read_at = 0.0  # monotonic time the last read that reached Redis began
        self._slice_at = 0.0  # perf_counter time the reader last let the loop run
        self._oversized: dict[str, bytes] = {}  # worker -> its last oversized entry read
        self._turn = 0  # rotates the read order (`readable`)
        self._drained = False  # the last read reached the end of every stream it read
        # `asked`: when a route's question starts the next read (monotonic; never while a
        # read runs), and what `run` waits on meanwhile.
        self._due = _NEVER
        self._waiter: asyncio.Future[None] | None = None

    async def poll(self, block_ms: int | None = None) -> int:
        """Read every readable stream once; with `block_ms`, again every POLL_S until
        something is read or `block_ms` has passed. Returns the entries read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (block_ms or 0) / 1000
        while True:
            failures = self.failures
            read = await self._poll_once()
            if read or self.failures != failures or loop.time() + POLL_S > deadline:
                return read
            await asyncio.sleep(POLL_S)

    def readable(self) -> dict[str, bytes | str]:
        """The cursors of the streams to read: those whose model has a block size and
        whose worker agrees with it. Each read starts one stream further along: a reply
        is bounded in bytes, so one busy stream must not always come first."""
        indexes, streams = self.feed.indexes, self.feed.streams
        now = time.perf_counter()
        items = [
            (w, s.cursor)
            for w, s in streams.items()
            if s.status != "block_size" and s.model in indexes and self._has_credit(s, now)
        ]
        self._turn += 1
        k = self._turn % len(items) if items else 0
        return dict(items[k:] + items[:k])

    def _has_credit(self, state: StreamState, now: float) -> bool:
        """Refill the stream's CPU credit; out of it, it waits (and is not trusted)."""
        if state.credited_at is None:
            state.credit = self.cpu_burst
        else:
            state.credit += (now - state.credited_at) * self.cpu_share
            state.credit = min(state.credit, self.cpu_burst)
        state.credited_at = now
        if state.credit > 0:
            return True
        self.throttled += 1
        if state.status == "ok":
            state.status = "lagging"  # behind its stream by choice: trust waits
        return False

    async def _poll_once(self) -> int:
        feed = self.feed
        self._slice_at = time.perf_counter()
        if feed.drops:  # (follow's: a departed or restarted worker, an unused model)
            await self._run_steps(feed.settle_drops(), None)
        cursors = self.readable()
        if not cursors:
            return 0
        read_at = time.monotonic()
        # The trim, when due, rides on this read (one round trip, not two: each costs the
        # busy reader ~0.3-0.5 ms of CPU, woken from its sleep, whatever it carries).
        trim = list(feed.streams) if self._trim_due() else []
        try:
            replies = await self.registry.read_kv_events(
                cursors, self.read_count, trim=trim, maxlen=self.stream_len
            )
            if trim:
                self._trimmed = time.monotonic()
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelled()
            self.failures += 1
            log.debug("KV event streams unreadable: %s", exc)
            return 0
        read = 0
        self._read_at = read_at
        self._slice_at = time.perf_counter()
        self._drained = all(len(entries) < self.read_count for _, entries in replies)
        for wid, entries in replies:
            for entry_id, fields in entries:
                state = feed.streams.get(wid)
                if state is None:  # (not while this task applies: follow runs between)
                    break
                if state.credit <= 0:
                    break  # its CPU share is spent: the rest waits in its stream
                state.cursor = entry_id
                read += 1
                if b"oversized" in fields:  # its read stopped there: more may follow
                    self._oversized[wid] = entry_id
                    self._drained = False
                await self._run_steps(feed.raw_steps(wid, fields), state)
            state = feed.streams.get(wid)
            if state is not None:
                self._check_lag(state, entries)
        await self._trim_oversized()
        return read

    async def _trim_oversized(self) -> None:
        """Trim each stream past the oversized entry just read (registry.py says why)."""
        while self._oversized:
            wid, entry_id = self._oversized.popitem()
            try:
                await self.registry.trim_kv_events_past(wid, entry_id)
            except (RedisError, OSError, TimeoutError) as exc:
                reraise_if_cancelled()
                log.debug("KV event stream %s not trimmed: %s", wid, exc)

    async def _run_steps(self, steps: Iterator[None], state: StreamState | None) -> None:
        """Run `steps`, letting the event loop run whenever `apply_budget` has passed since
        it last did (and after the last step); `state`'s stream pays for its steps."""
        clock = time.perf_counter
        began = clock()
        for _ in steps:
            now = clock()
            if now - self._slice_at > self.apply_budget:
                if state is not None:
                    state.credit -= now - began  # the stream pays its own steps only
                await asyncio.sleep(0)  # let requests and /health run between
                began = self._slice_at = clock()
        now = clock()
        if state is not None:
            state.credit -= now - began
        if now - self._slice_at > self.apply_budget:
            await asyncio.sleep(0)
            self._slice_at = clock()

    def _check_lag(self, state: StreamState, entries: Sequence[tuple[bytes, object]]) -> None:
        """A full read means more is waiting: behind by more than max_lag is untrusted."""
        if len(entries) < self.read_count:
            if state.status == "lagging":
                state.status = "ok"
            return
        last = entries[-1][0]
        ms = int((last.decode() if isinstance(last, bytes) else last).split("-")[0])
        if self.clock() - ms / 1000 > self.max_lag and state.status == "ok":
            state.status = "lagging"  # still applied: only trust waits

    async def run(self, members: Callable[[], Iterable[FeedMember]], idle: float) -> None:
        """Follow the fleet, read and trim forever (cancel to stop).

        How often it reads (each read is a Redis round trip: ~0.1 ms of the router's CPU
        in a loop that is awake anyway, ~0.3-0.5 ms woken by a timer of its own, whatever
        it brings): a read that leaves entries behind (a full page) is followed at once.
        One that read every stream to its end is followed when a route asks the index
        (`asked`) READ_GAP_S or more after it began, or after `idle` if no route asks: a
        busy router's reads start while its loop is awake for a request, and a router
        nobody routes through reads at the idle pace. An empty read waits twice as long as
        the last wait, up to `idle`. (Reading every 50 ms made this task most of what KV
        events cost a router behind one busy worker: ~20 reads a second, most of them
        empty; loadtests/results/router_cpu.md.)

        The index lags the streams by up to READ_GAP_S and the gap to the next request while
        routes ask, `idle` after a quiet spell: a route's own blocks are the tree's to
        predict meanwhile (merge.py's `in_flight_window`, 2 s). READ_GAP_S is not longer
        because a lag of ~1 s let the index outvote the tree with holdings already
        flushed: in the simulator's divergence cases (3 seeds, 64 workers) events kept
        +0.3 / +0.1 / +0.8 points of hit rate over the tree alone in flush / flush_half /
        restart at 0.25 s of lag, and fell to -0.9 / -0.5 / +0.4 at 1.05 s.

        Its owner sets `stopping` before it cancels: a cancel that meets redis-py's own
        timeout can be lost (shared/serving/aio.py `stop_task`), and the loop then ends at
        its next turn instead of reading on until the owner gives up waiting."""
        wait = POLL_S
        while not self.stopping:
            self.feed.follow(members())
            failures = self.failures
            if not self.feed.streams:
                await asyncio.sleep(idle)
                continue
            read = await self.poll()
            if self._trim_due():  # (no read carried it: none readable, or it failed)
                await self.trim()
            if self.failures != failures:
                await asyncio.sleep(idle)
            elif not read:
                wait = min(idle, wait * 2)
                await asyncio.sleep(wait)
            elif self._drained:
                wait = READ_GAP_S
                await self._until_asked(idle)

    def asked(self) -> None:
        """A route asked the index: the next read starts now if it is due (`run`)."""
        if time.monotonic() >= self._due:
            self._due = _NEVER
            _wake(self._waiter)

    async def _until_asked(self, longest: float) -> None:
        """Until a route asks READ_GAP_S or more after the last read began, or `longest`."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(longest, _wake, waiter)
        self._due = self._read_at + READ_GAP_S
        try:
            await waiter
        finally:
            timer.cancel()
            self._due, self._waiter = _NEVER, None

    def stop(self) -> None:
        """`run` ends at its next turn (see its docstring), at once if it waits for a route."""
        self.stopping = True
        _wake(self._waiter)

    def _trim_due(self) -> bool:
        return time.monotonic() - self._trimmed > TRIM_EVERY_S

    async def trim(self) -> None:
        self._trimmed = time.monotonic()
        try:
            await self.registry.trim_kv_events(list(self.feed.streams), self.stream_len)
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelled()
            log.debug("KV event streams not trimmed: %s", exc)
