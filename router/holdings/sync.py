"""Router replicas route as one: routing decisions and in-flight load shared through Redis.

Behind a Kubernetes Service, consecutive turns of one conversation reach different
router replicas. A replica that learns only from its own requests sends turn 2 to a
worker picked without knowing where turn 1 went, and the KV cache built by turn 1 is
wasted. So every replica:

- `publish(worker_id, key)` on each decision, `key` being what the tree keys on: the
  routed text, or the prompt token ids when the router has a `tokenizer` (those entries
  carry the tokenizer's fingerprint; router/holdings/sync_wire.py). The hot path only
  appends the key to a bounded in-memory buffer (no encoding, no compression; a repeat
  of the decision just buffered is not buffered again, see `publish`). A flusher task
  sends the buffer every `sync_flush_interval` as one stream entry (more where a flush
  holds more than `MAX_RECORDS` records or `max_batch_bytes`,
  router/holdings/sync_batch.py): keys capped at `sync_max_chars` elements, one zlib
  stream and one XADD an entry. The stream is trimmed to about `sync_stream_maxlen`
  decisions (`_maxlen`). No Redis round trip happens before forwarding.
- A reader task applies the other replicas' decisions to its own trees through
  `Policy.observe`, every one in order (an entry's decisions at one time), reading at
  most once a `sync_flush_interval` under load; a tree on
  tokens skips text entries (written by a replica of the version before tokens, during
  a rolling upgrade: counted in `skipped`). On start it first replays the whole
  (bounded) stream, READ_ENTRIES entries a page, so a replica that starts late or
  restarts recovers the fleet's affinity instead of starting empty; after a Redis
  outage it resumes from the last entry it applied. It reads the entries of the
  versions before batches too (an entry a decision or session, a rolling upgrade).
- `publish_session(worker_id, digest, pin_ttl, placed)` on each prompt_cache_key
  session placed, and on each call that keeps one with a pin
  (router/holdings/sessions.py): an `s` record in the same entries, `worker id SEP
  digest KIND pin-ms` (router/holdings/sync_wire.py); the reader hands it to `on_session` (the
  proxy's session table), so siblings of one session co-locate whichever replica each
  reaches, and every replica knows how long the session's context is pinned.
- Every `sync_load_interval` it writes its in-flight count per worker to a short-lived
  hash and reads the other replicas' hashes; `remote_inflight()` is their sum, which the
  fleet adds to its own in-flight count when computing load.

If Redis is unreachable, each replica keeps routing on what it knows (per-replica
routing) and the tasks retry with backoff; nothing here raises into request handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.holdings.sync_batch import FIELD, SyncBatchReader, next_entry, session_record
from router.holdings.sync_wire import (
    SEP,
    Key,
    SessionEntry,
    add_loads,
    decode_decision,
    decode_session,
)
from shared.config import RouterConfig
from shared.serving.aio import reraise_if_cancelled
from shared.tokens.prompt_ids import TokenKey, token_key
from shared.wire.peers import Rejections
from shared.wire.registry import MAX_WORKERS, Registry

log = logging.getLogger(__name__)

# Decisions buffered while Redis is unreachable; beyond either bound the oldest are
# dropped. The buffer holds the keys themselves (encoded at the flush, off the request).
PENDING_MAX = 10_000
PENDING_MAX_CHARS = 32 * 2**20
# Stream entries read at a time: each up to MAX_RECORDS decisions, applied on the loop.
READ_ENTRIES = 16
# The fewest entries the stream is trimmed to (`_maxlen`), whatever the batch sizes.
MIN_ENTRIES = 100

Observe = Callable[[str, Key, float], None]  # (worker_id, text or TokenKey, now)
# A session placed or kept with a pin (router/holdings/sessions.py), and when it arrived.
ObserveSession = Callable[[SessionEntry, float], None]
# Other replicas' load hashes read per round; more is not a fleet of routers but a flood.
MAX_REPLICAS = 256


class ReplicaSync(Protocol):
    """What the router app and its proxy need of replica sync (`DecisionSync` is one);
    given to `create_app` and the `Proxy` at construction."""

    on_session: ObserveSession | None

    def publish(self, worker_id: str, key: str | Sequence[int] | np.ndarray) -> None: ...

    def publish_session(
        self, worker_id: str, digest: bytes, pin_ttl: float = 0.0, placed: bool = True
    ) -> None: ...

    def remote_inflight(self) -> Mapping[str, int]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class DecisionSync:
    def __init__(
        self,
        redis: Redis,
        registry: Registry,
        config: RouterConfig,
        observe: Observe,
        local_inflight: Callable[[], Mapping[str, int]],
        clock: Callable[[], float] = time.monotonic,
        replica_id: str | None = None,
        rejections: Rejections | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.redis = redis
        self.rejections = rejections if rejections is not None else registry.rejections
        self.registry = registry
        self.config = config
        self.observe = observe
        # This router's tokenizer (shared/tokens/fingerprint.py): token entries are
        # written with it and read only when they carry it. None: the tree keys on text.
        self.fingerprint = fingerprint
        self.local_inflight = local_inflight
        self.clock = clock
        # A fresh id per process: a restarted replica replays its own earlier decisions too.
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._header = self.replica_id.encode() + SEP
        # (worker id, text or TokenKey) a decision, bytes a session record: encoded at
        # the flush. `_pending_chars`: the keys' lengths, for PENDING_MAX_CHARS.
        self._pending: deque[tuple[str, str] | bytes] = deque()
        self._pending_chars = 0
        self._last_decision: tuple[str, str] | None = None  # the last decision buffered
        self._reader = SyncBatchReader(config.sync_max_chars, fingerprint)
        # Decisions an entry holds, a moving average over the entries this replica wrote
        # and read: the stream keeps about `sync_stream_maxlen` / this entries (`_maxlen`).
        self._per_entry = 1.0
        self._wakeup = asyncio.Event()
        self._last_id = "0-0"
        self._remote: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.applied = 0
        self.skipped = 0  # entries of the other kind (text for a tree on tokens)
        self.published = 0
        self.caught_up = asyncio.Event()
        self._stopping = False
        self._owns_redis = False
        # Where the other replicas' session placements go (the proxy's session table).
        self.on_session: ObserveSession | None = None

    @classmethod
    def connect(
        cls,
        config: RouterConfig,
        observe: Observe,
        local_inflight: Callable[[], Mapping[str, int]],
        clock: Callable[[], float] = time.monotonic,
        rejections: Rejections | None = None,
        fingerprint: str | None = None,
    ) -> DecisionSync:
        """A sync on its own Redis client (to `config.redis_url`), closed by `stop`."""
        assert config.redis_url
        redis = Redis.from_url(config.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        sync = cls(
            redis, Registry(redis, config.redis_prefix, rejections), config, observe,
            local_inflight, clock, fingerprint=fingerprint,
        )  # fmt: skip
        sync._owns_redis = True
        return sync

    # -- hot path ---------------------------------------------------------------------
    def publish(self, worker_id: str, key: str | Sequence[int] | np.ndarray) -> None:
        """`key`: what this router's tree keyed the decision on (text, or prompt ids).
        Buffered as it is: encoding and compression happen at the flush, once an entry."""
        if not isinstance(key, str) or type(key) is TokenKey:
            if self.fingerprint is None:
                return  # ids without a tokenizer to name them: nothing a replica could use
            if type(key) is not TokenKey:
                key = token_key(key[: self.config.sync_max_chars])  # type: ignore[assignment]
                if not key:
                    return  # no ids, or not token ids (a client's prompt of any ints)
        last = self._last_decision
        if last is not None and last[1] == key and last[0] == worker_id:
            # The decision just buffered, again: a reader applies a flush's decisions at
            # one time, so the repeat would refresh nothing the first does not. Exact for
            # any traffic; it saves work only where a prompt repeats at once (a load test,
            # retries, one popular prompt), not on a fleet of distinct conversations.
            return
        item = self._last_decision = (worker_id, key)  # type: ignore[assignment]
        self._buffer(item, len(key))

    def publish_session(
        self, worker_id: str, digest: bytes, pin_ttl: float = 0.0, placed: bool = True
    ) -> None:
        """A prompt_cache_key session placed (or, `placed` False, kept) on `worker_id`,
        whose call asked for a pin of `pin_ttl` seconds there (its tenant-namespaced
        digest: the key itself never leaves this router)."""
        record = session_record(worker_id, digest, pin_ttl, placed)
        self._last_decision = None
        self._buffer(record, len(record))

    def _buffer(self, item: tuple[str, str] | bytes, chars: int) -> None:
        pending = self._pending
        pending.append(item)
        self._pending_chars += chars
        while len(pending) > PENDING_MAX or self._pending_chars > PENDING_MAX_CHARS:
            self._pending_chars -= _chars(pending.popleft())  # Redis away: oldest first
        self._wakeup.set()

    def remote_inflight(self) -> Mapping[str, int]:
        return self._remote

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(self._flush_once, "flush"), name="sync-flush"),
            asyncio.create_task(self._run(self._read_once, "read"), name="sync-read"),
            asyncio.create_task(self._run(self._load_once, "load"), name="sync-load"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # redis-py may turn a cancellation mid-read into a ConnectionError; the
            # `_stopping` flag ends the retry loop either way.
            await asyncio.wait(self._tasks, timeout=5)
        with contextlib.suppress(RedisError, OSError):
            await self._send_pending()
            await self.redis.delete(self.registry.router_key(self.replica_id))
        if self._owns_redis:
            await self.redis.aclose()

    async def _run(self, step: Callable[[], object], what: str) -> None:
        """Run `step` forever; on Redis errors back off (0.1 s doubling to 2 s) and retry."""
        backoff = 0.1
        failing = False
        while not self._stopping:
            try:
                await step()  # type: ignore[misc]
                if failing:
                    log.info("replica sync (%s) reconnected to Redis", what)
                failing, backoff = False, 0.1
            except (RedisError, OSError) as e:
                reraise_if_cancelled()
                if not failing:
                    log.warning(
                        "replica sync (%s): Redis unavailable (%s); routing per replica", what, e
                    )
                failing = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:
                if self._stopping:
                    return
                log.exception("replica sync (%s) failed; retrying", what)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # -- tasks ------------------------------------------------------------------------
    async def _flush_once(self) -> None:
        self._wakeup.clear()
        if not self._pending:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=1.0)
            return
        await self._send_pending()
        await asyncio.sleep(self.config.sync_flush_interval)

    async def _send_pending(self) -> None:
        """The buffer as entries, one XADD each (usually one a flush). An entry per
        decision cost one XADD in Redis and a reply parse in every reader per decision,
        and a zlib call per decision on the request's path (loadtests/results/router_cpu.md)."""
        if not self._pending:
            return
        items = list(self._pending)
        self._pending, self._pending_chars, self._last_decision = deque(), 0, None
        stream, done = self.registry.decisions_stream, 0
        try:
            while done < len(items):
                value, taken, records = next_entry(
                    items, done, self._header, self.fingerprint, self.config.sync_max_chars
                )
                if value is not None:
                    await self.redis.xadd(
                        stream, {FIELD: value}, maxlen=self._maxlen(), approximate=True
                    )
                    self._per_entry += 0.1 * (records - self._per_entry)
                    self.published += records
                done += taken
        except BaseException:
            # Unsent items go back in front of what arrived meanwhile (the oldest dropped
            # first where that overflows the buffer): Redis answers again, they are sent.
            for item in reversed(items[done:]):
                self._pending.appendleft(item)
                self._pending_chars += _chars(item)
            while len(self._pending) > PENDING_MAX or self._pending_chars > PENDING_MAX_CHARS:
                self._pending_chars -= _chars(self._pending.popleft())
            raise

    def _maxlen(self) -> int:
        """Entries the stream is trimmed to: about `sync_stream_maxlen` decisions at the
        decisions an entry held of late (written and read here: the fleet's), never under
        MIN_ENTRIES. So Redis holds about what that many decisions take, as when an entry
        was a decision, and a replica that starts replays about that many."""
        return max(MIN_ENTRIES, round(self.config.sync_stream_maxlen / self._per_entry))

    async def _read_once(self) -> None:
        if not self.caught_up.is_set():
            # Replay the bounded stream from its start, in pages.
            while True:
                start = "-" if self._last_id == "0-0" else f"({self._last_id}"
                page = await self.redis.xrange(
                    self.registry.decisions_stream, min=start, count=READ_ENTRIES
                )
                self._apply(page, include_own=True)
                if len(page) < READ_ENTRIES:
                    break
            self.caught_up.set()
            return
        reply = await self.redis.xread(
            {self.registry.decisions_stream: self._last_id}, count=READ_ENTRIES, block=1000
        )
        for _stream, entries in reply or ():
            self._apply(entries, include_own=False)
        if reply:
            # A blocked read returns at the first entry, its own replica's included: under
            # load that is a round trip per entry of every replica. Waiting a flush
            # interval before the next read takes what arrived meanwhile in one, so a
            # reader reads at most once an interval (as a writer writes), however many
            # replicas write; an idle reader still wakes at the first entry.
            await asyncio.sleep(self.config.sync_flush_interval)

    def _apply(self, entries: list, include_own: bool) -> None:
        """Apply other replicas' decisions; a malformed entry or record
        (router/holdings/sync_wire.py) is dropped, counted and logged, and the reader goes on."""
        now = self.clock()
        on_tokens = self.fingerprint is not None
        for entry_id, fields in entries:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            batch = fields.get(FIELD)
            if batch is not None:
                if include_own or not batch.startswith(self._header):
                    self._apply_batch(batch, now, on_tokens)
                continue
            # An entry of the versions before batches (a rolling upgrade): one item.
            session = fields.get(b"s")
            entry = fields.get(b"d", b"") if session is None else session
            if not include_own and entry.startswith(self._header):
                continue
            if session is not None:
                self._apply_session(session, now)
                continue
            try:
                worker_id, key = decode_decision(
                    entry, self.config.sync_max_chars, self.fingerprint
                )
            except ValueError as e:
                self.rejections.reject("sync_decisions", "stream entry", str(e))
                continue
            if (type(key) is TokenKey) != on_tokens:
                # A text decision for a tree on tokens: an older replica's, in a rolling
                # upgrade (its text cannot be turned back into the ids it routed).
                self.skipped += 1
                continue
            # Workers not (yet) in this replica's table are applied too: a replica that
            # restarts replays the stream before discovery has found any worker.
            self.observe(worker_id, key, now)
            self.applied += 1

    def _apply_batch(self, batch: bytes, now: float, on_tokens: bool) -> None:
        try:
            records = self._reader.read(batch)
        except ValueError as e:
            self.rejections.reject("sync_decisions", "stream entry", str(e))
            return
        self._per_entry += 0.1 * (len(records) - self._per_entry)
        observe, on_session = self.observe, self.on_session
        for record in records:
            kind = type(record)
            if kind is tuple:
                worker_id, key = record  # type: ignore[misc]
                if (type(key) is TokenKey) != on_tokens:
                    self.skipped += 1  # text for a tree on tokens, as in `_apply`
                    continue
                observe(worker_id, key, now)
                self.applied += 1
            elif kind is SessionEntry:
                if on_session is not None:
                    on_session(record, now)  # type: ignore[arg-type]
                    self.applied += 1
            else:
                self.rejections.reject(record.source, "stream entry", record.why)  # type: ignore[union-attr]

    def _apply_session(self, entry: bytes, now: float) -> None:
        try:
            session = decode_session(entry)
        except ValueError as e:
            self.rejections.reject("sync_sessions", "stream entry", str(e))
            return
        if self.on_session is not None:
            self.on_session(session, now)
            self.applied += 1

    async def _load_once(self) -> None:
        interval = self.config.sync_load_interval
        known = self.local_inflight()
        mine = {k: v for k, v in known.items() if v > 0}
        own_key = self.registry.router_key(self.replica_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(own_key)
            if mine:
                pipe.hset(own_key, mapping=mine)
                pipe.pexpire(own_key, int(interval * 4 * 1000))
            await pipe.execute()
        remote: dict[str, int] = {}
        replicas = 0
        async for key in self.redis.scan_iter(match=self.registry.router_pattern, count=100):
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            if name == own_key:
                continue
            replicas += 1
            if replicas > MAX_REPLICAS:
                self.rejections.reject("sync_load", "router keys", f"over {MAX_REPLICAS}")
                break
            # Counted before it is read: a flooded hash is never pulled into memory.
            if await self.redis.hlen(name) > MAX_WORKERS:
                self.rejections.reject("sync_load", name, f"over {MAX_WORKERS} entries")
                continue
            counts = await self.redis.hgetall(name)
            for why in add_loads(remote, counts, known, self.config.max_concurrent):
                self.rejections.reject("sync_load", name, why)
        # A new mapping tells the fleet the loads moved (it then walks every worker on the
        # next request), so an unchanged round keeps the old one.
        if remote != self._remote:
            self._remote = remote
        await asyncio.sleep(interval)


def _chars(item: tuple[str, str] | bytes) -> int:
    """What a buffered item counts against PENDING_MAX_CHARS."""
    return len(item) if type(item) is bytes else len(item[1])
