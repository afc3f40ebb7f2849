"""The worker's KV events onto its Redis stream (shared/wire/registry.py names the key).

Every `kv_events_interval` the publisher drains the radix cache's events
(worker/engine/kv_blocks.py) and appends them as entries of at most `MAX_EVENTS` events
(or about `MAX_TOKENS` token ids), each stamped with the worker's id, its epoch and a
sequence number that starts at 0 in the epoch and grows by one per entry. A router that
sees the sequence jump knows it missed something and stops trusting the index for this
worker until it resyncs.

Resync points: the epoch's first entry starts with AllBlocksCleared (an empty cache),
and every `stream_len // 2` entries the cache republishes itself (AllBlocksCleared, then
every block it holds), so a reader that starts after the stream trimmed the epoch's
first entries still finds one in what the stream keeps.

Redis down: the entry not written is kept and retried (the sequence does not move on);
events pile up in the cache's bounded backlog, which on overflow republishes the tree.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from shared.serving.aio import reraise_if_cancelled
from shared.wire.kv_events import encode_batch
from shared.wire.registry import Registry
from worker.engine.kv_blocks import BlockEvents

log = logging.getLogger(__name__)

MAX_EVENTS = 512
MAX_TOKENS = 65_536


class KvEventPublisher:
    def __init__(
        self,
        registry: Registry,
        worker_id: str,
        epoch: float,
        source: Callable[[], BlockEvents | None],
        stream_len: int,
        interval: float,
    ) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.epoch = epoch
        self.source = source  # the engine's events, once it has loaded
        self.stream_len = stream_len
        self.interval = interval
        self.seq = 0  # the next entry's sequence number
        self.failures = 0
        self._payload: bytes | None = None  # drained but not yet written
        self._failing = False

    async def run(self, ready: asyncio.Event) -> None:
        await ready.wait()
        while True:
            await self.flush()
            await asyncio.sleep(self.interval)

    async def flush(self) -> int:
        """Write everything pending; returns the entries written (0 when Redis failed)."""
        events = self.source()
        written = 0
        while events is not None:
            if self._payload is None:
                batch = events.drain(MAX_EVENTS, MAX_TOKENS)
                if not batch:
                    break
                self._payload = encode_batch(batch)
            try:
                await self.registry.append_kv_events(
                    self.worker_id, self.epoch, self.seq, self._payload, self.stream_len
                )
            except (RedisError, OSError, TimeoutError) as exc:
                reraise_if_cancelled()
                self.failures += 1
                if not self._failing:
                    log.warning("KV events to Redis failed (%s); retrying", exc)
                self._failing = True
                return written
            self._failing = False
            self._payload = None
            self.seq += 1
            written += 1
            if self.seq % max(1, self.stream_len // 2) == 0:
                events.request_republish()
        return written
