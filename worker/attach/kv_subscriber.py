"""`radix-worker attach --kv-events ENDPOINT`: a stock engine's ZMQ KV events to our stream.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`) and SGLang publish
each batch as three frames on a PUB socket:

    topic | sequence (8 bytes, big-endian) | msgpack batch (shared/wire/kv_events.py)

and answer replay requests on a ROUTER socket: send `[b"", start_seq]` (8 bytes,
big-endian), receive `[b"", topic, seq, payload]` for every buffered batch from
`start_seq` on, then `[b"", b"", -1, b""]`. This is vLLM's ZmqEventPublisher protocol.

The subscriber keeps the sequence it expects. On a jump it asks the replay socket for
what it missed; on start it asks for everything the publisher still buffers (from 0),
so a sidecar started after the engine learns what the engine already cached. Missed
batches it cannot get back (no replay socket, or the publisher dropped them) make a gap
in *our* stream's sequence too, followed at once by an empty entry marked `resync`: a
stock engine never republishes its cache, so routers could not wait for a known state
(an AllBlocksCleared may never come). A router that reads the marker resets this
worker's index and rebuilds it from the events that follow, scoring the worker on its
index and its tree together until the engine's pool has turned over
(router/holdings/kv_feed.py, "rebuilding"); a router of the version before the marker sees
the hole and routes the worker on its tree alone, as it did. The marker is an entry of
its own (an empty batch), so it says that this writer gave up on the hole, apart from
entries a router missed on its side (a trimmed stream).

The forwarder writes batches re-encoded (validated, unknown fields dropped) under the
heartbeat's epoch; a new epoch starts at sequence 0 with an AllBlocksCleared, as our own
workers' streams do, but only when the subscriber holds every batch the engine published
since it started (the first it got was sequence 0). A sidecar started next to an engine
that has run for a while, whose replay buffer no longer holds the start, cannot claim an
empty cache: the epoch's first entry is then a `resync` marker, and routers rebuild.

Bounds (the publisher is a peer, not trusted: issue 30 saw one 1 GB frame take the
sidecar to 2 GB, and a replay with no end grow it to 1.2 GB in 20 s): both sockets refuse
messages over MAX_FRAME_BYTES (ZMQ MAXMSGSIZE: the peer is disconnected, nothing is
buffered), and a replay stops, as a failed one, past REPLAY_MAX_BATCHES batches,
REPLAY_MAX_BYTES of payload or REPLAY_MAX_S seconds. The subscriber reports the block
size its engine's events name (`on_block_size`): the sidecar's heartbeat carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from shared.serving.aio import reraise_if_cancelled
from shared.wire.kv_events import (
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    decode_batch,
    encode_batch,
)
from shared.wire.registry import Registry

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
LOST = None  # queued in place of batches that could not be recovered
MAX_FRAME_BYTES = MAX_BATCH_BYTES + 4096  # one ZMQ message: a batch and its frames
# vLLM buffers 10,000 steps for replay (KVEventsConfig.buffer_steps): a replay of more is
# not one; 256 MiB of payload and 30 s bound what one replay may hold and take.
REPLAY_MAX_BATCHES = 10_000
REPLAY_MAX_BYTES = 256 * 1024 * 1024
REPLAY_MAX_S = 30.0


class ZmqEventSubscriber:
    """Decoded batches, in the publisher's order, onto `out` (LOST marks a hole)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, out: asyncio.Queue, topic: str = ""
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.out = out
        self.topic = topic.encode()
        self.expected: int | None = None
        # The first sequence number got from the engine's current run: 0 means every
        # batch since the engine started is known (an AllBlocksCleared is then true).
        self.first_seq: int | None = None
        self.received = 0
        self.replayed = 0
        self.dropped = 0  # frames that were not a valid batch
        self.lost = 0  # holes that replay could not fill
        self.block_size = 0  # the engine's, from its BlockStored events (0: none seen)
        self.on_block_size: Callable[[int], None] = lambda size: None
        self._ctx = zmq.asyncio.Context()

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.connect(self.endpoint)
        try:
            await self._catch_up(0)
            while True:
                frames = await sub.recv_multipart()
                seq, events = self._parse(frames)
                if seq is None:
                    continue
                if self.expected is not None and seq > self.expected:
                    await self._catch_up(self.expected, before=seq)
                elif self.expected is not None and seq < self.expected:
                    if seq != 0:
                        continue  # a duplicate (replayed meanwhile)
                    log.info("KV event sequence restarted at 0: the engine restarted")
                    self.first_seq = 0
                if self.first_seq is None:
                    self.first_seq = seq
                self.expected = seq + 1
                self.received += 1
                self._put(events)
        finally:
            sub.close(0)
            self._ctx.term()

    def _parse(self, frames: list[bytes]) -> tuple[int | None, list[KVEvent]]:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.dropped += 1
            return None, []
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            events = list(decode_batch(frames[2]).events)
        except ValueError as exc:
            self.dropped += 1
            log.warning("dropped a KV event batch (seq %d): %s", seq, exc)
            return None, []
        for e in events:
            if isinstance(e, BlockStored) and e.block_size and e.block_size != self.block_size:
                self.block_size = e.block_size
                self.on_block_size(e.block_size)
        return seq, events

    def complete(self) -> bool:
        """Every batch of the engine's current run has been received (from sequence 0)."""
        return self.first_seq == 0

    def _put(self, events: list[KVEvent] | None) -> None:
        try:
            self.out.put_nowait(events)
        except asyncio.QueueFull:
            self.lost += 1  # the forwarder is stuck (Redis down): a hole routers will see
            with contextlib.suppress(asyncio.QueueEmpty):
                self.out.get_nowait()
            self.out.put_nowait(LOST)

    async def _catch_up(self, start: int, before: int | None = None) -> None:
        """Batches start..before-1 from the replay socket; LOST where that fails."""
        got = await self._replay(start, before) if self.replay_endpoint else None
        if got is None:
            if before is not None:  # a hole we cannot fill
                self.lost += 1
                self._put(LOST)
            return
        for seq, events in got:
            if self.first_seq is None:
                self.first_seq = seq
            self.expected = seq + 1
            self.replayed += 1
            self._put(events)
        if before is not None and (self.expected or 0) < before:
            self.lost += 1
            self._put(LOST)

    async def _replay(self, start: int, before: int | None) -> list | None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.replay_endpoint)  # type: ignore[arg-type]
        got: list[tuple[int, list[KVEvent]]] = []
        loop = asyncio.get_running_loop()
        ends = loop.time() + REPLAY_MAX_S
        held = 0
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                wait = min(REPLAY_TIMEOUT_S, ends - loop.time())
                frames = await asyncio.wait_for(sock.recv_multipart(), max(wait, 0.0))
                held += sum(len(f) for f in frames)
                if len(got) >= REPLAY_MAX_BATCHES or held > REPLAY_MAX_BYTES:
                    log.warning("KV event replay past %d batches or %d bytes: dropped",
                                REPLAY_MAX_BATCHES, REPLAY_MAX_BYTES)  # fmt: skip
                    return None
                if len(frames) == 4 and frames[2] == END_SEQ.to_bytes(8, "big", signed=True):
                    break  # (its empty payload is no batch: not parsed, not counted)
                seq, events = self._parse(frames[1:]) if len(frames) == 4 else (None, [])
                if seq is None or (before is not None and seq >= before):
                    continue
                if not got and seq != start:
                    log.warning("replay starts at %d, not %d: batches are lost", seq, start)
                    if before is not None:
                        return None
                got.append((seq, events))
        except TimeoutError:
            log.warning("KV event replay from %s timed out", self.replay_endpoint)
            return None
        finally:
            sock.close(0)
        return got


async def forward(
    queue: asyncio.Queue, registry: Registry, worker_id: str, epoch: Callable[[], float],
    stream_len: int, complete: Callable[[], bool] = lambda: True,
) -> None:  # fmt: skip
    """Queued batches onto the worker's stream, under the heartbeat's current epoch.
    `complete()`: whether every batch since the engine started has been queued (the
    subscriber's `complete`); else a new epoch starts with a resync marker, not a clear."""
    current, seq = 0.0, 0
    while True:
        events = await queue.get()
        now = epoch()
        while now <= 0:  # not identified yet: the heartbeat has not started an epoch
            await asyncio.sleep(0.1)
            now = epoch()
        resync = events is LOST
        if now != current:
            current, seq = now, 0
            if complete() and not resync:
                events = [AllBlocksCleared(), *(events or ())]
            else:  # the engine may hold blocks from batches never seen: not a known state
                resync = True
        elif resync:
            seq += 1  # the hole, then the marker: readers must not trust what came before
        payload = encode_batch(events or [])
        while True:
            try:
                await registry.append_kv_events(
                    worker_id, current, seq, payload, stream_len, resync=resync
                )
                # redis-py can swallow a cancellation that lands mid-command and return:
                # without this the task would wait on the queue forever, cancelled.
                reraise_if_cancelled()
                break
            except (RedisError, OSError, TimeoutError) as exc:
                reraise_if_cancelled()
                log.warning("KV events to Redis failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
        seq += 1
