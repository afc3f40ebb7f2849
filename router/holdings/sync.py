"""Router replicas route as one: routing decisions and in-flight load shared through Redis.

Behind a Kubernetes Service, consecutive turns of one conversation reach different
router replicas. A replica that learns only from its own requests sends turn 2 to a
worker picked without knowing where turn 1 went, and the KV cache built by turn 1 is
wasted. So every replica:

- `publish(worker_id, key)` on each decision, `key` being what the tree keys on: the
  routed text, or the prompt token ids when the router has a `tokenizer` (those entries
  carry the tokenizer's fingerprint; router/holdings/sync_wire.py). The hot path only
  appends to a bounded in-memory buffer; a flusher task sends the buffer every
  `sync_flush_interval` as one script call that XADDs each entry (stream trimmed near
  `sync_stream_maxlen` entries, keys capped at `sync_max_chars` elements and
  zlib-compressed, one field per entry). No Redis round trip happens before forwarding.
- A reader task applies the other replicas' decisions to its own trees through
  `Policy.observe`; a tree on tokens skips text entries (written by a replica of the
  version before tokens, during a rolling upgrade: counted in `skipped`). On start it first replays the whole (bounded) stream, so a replica
  that starts late or restarts recovers the fleet's affinity instead of starting empty;
  after a Redis outage it resumes from the last entry it applied.
- `publish_session(worker_id, digest, pin_ttl, placed)` on each prompt_cache_key
  session placed, and on each call that keeps one with a pin
  (router/holdings/sessions.py): a field `s`, `replica id SEP worker id SEP digest
  KIND pin-ms` (router/holdings/sync_wire.py); the reader hands it to `on_session` (the
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

from router.holdings.sync_wire import (
    SEP,
    Key,
    SessionEntry,
    add_loads,
    decode_decision,
    decode_session,
    encode_decision,
    encode_session,
    encode_tokens,
)
from shared.config import RouterConfig
from shared.serving.aio import reraise_if_cancelled
from shared.tokens.prompt_ids import TokenKey
from shared.wire.peers import Rejections
from shared.wire.registry import MAX_WORKERS, Registry

log = logging.getLogger(__name__)

# Marks a buffered session entry (a decision entry starts with the replica id: hex).
SESSION = b"\x01"
# Decisions buffered while Redis is unreachable; beyond this the oldest are dropped.
PENDING_MAX = 10_000

Observe = Callable[[str, Key, float], None]  # (worker_id, text or TokenKey, now)
# A session placed or kept with a pin (router/holdings/sessions.py), and when it arrived.
ObserveSession = Callable[[SessionEntry, float], None]
# Entries sent in one script call: Redis refuses a query over 1 GB, and entries are
# bounded by what `sync_max_chars` allows (router/holdings/sync_wire.py).
APPEND_MAX_ENTRIES = 512
# XADD each (field, value) pair of ARGV[2..] as one entry, then one approximate trim
# (instead of MAXLEN on every XADD: the same bound, fewer arguments). The stream keeps
# one entry per decision, so readers and `sync_stream_maxlen` mean what they did.
_APPEND = """
local stream = KEYS[1]
for i = 2, #ARGV, 2 do
  redis.call('XADD', stream, '*', ARGV[i], ARGV[i + 1])
end
redis.call('XTRIM', stream, 'MAXLEN', '~', ARGV[1])
return (#ARGV - 1) / 2
"""
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
        self._pending: deque[bytes] = deque(maxlen=PENDING_MAX)
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
        """`key`: what this router's tree keyed the decision on (text, or prompt ids)."""
        cap = self.config.sync_max_chars
        if isinstance(key, str) and type(key) is not TokenKey:
            entry = encode_decision(self._header, worker_id, key, cap)
        elif self.fingerprint is not None:
            entry = encode_tokens(self._header, worker_id, key, self.fingerprint, cap)
            if entry is None:
                return  # not token ids (a client's prompt of any ints): not shared
        else:
            return  # ids without a tokenizer to name them: nothing a replica could use
        self._pending.append(entry)
        self._wakeup.set()

    def publish_session(
        self, worker_id: str, digest: bytes, pin_ttl: float = 0.0, placed: bool = True
    ) -> None:
        """A prompt_cache_key session placed (or, `placed` False, kept) on `worker_id`,
        whose call asked for a pin of `pin_ttl` seconds there (its tenant-namespaced
        digest: the key itself never leaves this router)."""
        entry = encode_session(self._header, worker_id, digest, pin_ttl, placed)
        self._pending.append(SESSION + entry)
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
        if not self._pending:
            return
        batch, self._pending = self._pending, deque(maxlen=PENDING_MAX)
        try:
            stream = self.registry.decisions_stream
            entries = list(batch)
            for start in range(0, len(entries), APPEND_MAX_ENTRIES):
                await self._append(stream, entries[start : start + APPEND_MAX_ENTRIES])
        except BaseException:
            # Unsent decisions go back in front of what arrived meanwhile (oldest dropped
            # first); a chunk that did reach Redis before the failure is sent again, as a
            # pipeline's partly applied batch was: an entry applied twice is harmless.
            batch.extend(self._pending)
            self._pending = batch
            raise
        self.published += len(batch)

    async def _append(self, stream: str, entries: list[bytes]) -> None:
        """One command for `entries` (`_APPEND`): a pipelined XADD each cost redis-py 12 us
        of packing and reply parsing per entry on this machine, more than the decision's
        own zlib (5 us); one script call with every entry as an argument costs ~1 us each."""
        args: list[bytes | int] = [self.config.sync_stream_maxlen]
        for entry in entries:
            if entry.startswith(SESSION):
                args += (b"s", entry[len(SESSION) :])
            else:
                args += (b"d", entry)
        await self.redis.eval(_APPEND, 1, stream, *args)  # type: ignore[misc]

    async def _read_once(self) -> None:
        if not self.caught_up.is_set():
            # Replay the bounded stream from its start, in pages.
            while True:
                start = "-" if self._last_id == "0-0" else f"({self._last_id}"
                page = await self.redis.xrange(
                    self.registry.decisions_stream, min=start, count=1000
                )
                self._apply(page, include_own=True)
                if len(page) < 1000:
                    break
            self.caught_up.set()
            return
        reply = await self.redis.xread(
            {self.registry.decisions_stream: self._last_id}, count=1000, block=1000
        )
        for _stream, entries in reply or ():
            self._apply(entries, include_own=False)

    def _apply(self, entries: list, include_own: bool) -> None:
        """Apply other replicas' decisions; a malformed entry (router/holdings/sync_wire.py) is
        dropped, counted and logged, and the reader goes on."""
        now = self.clock()
        on_tokens = self.fingerprint is not None
        for entry_id, fields in entries:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
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
