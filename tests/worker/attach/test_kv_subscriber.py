"""attach's ZMQ subscriber and forwarder, against a publisher speaking vLLM's protocol.

`Publisher` is a stand-in for vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py,
which cannot be imported here: vllm lives in its own venv; tests/e2e/test_attach_vllm.py
runs the real one): real ZMQ sockets, the same frames (topic, 8-byte sequence, msgpack
batch), the same ROUTER replay answer and end marker. The batches go through a real
Redis-protocol server into the router's feed.
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio
from redis.asyncio import Redis

from router.fleet.kv_feed import FeedMember, KvEventFeed
from shared.redis_server import free_port
from shared.wire.kv_events import AllBlocksCleared, BlockStored, encode_batch, parse_entry
from shared.wire.registry import Registry
from worker.attach.kv_subscriber import ZmqEventSubscriber, forward

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        port, replay = free_port(), free_port()
        self.endpoint, self.replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://*:{port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://*:{replay}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, events, *, send: bool = True, keep: bool = True) -> None:
        payload = encode_batch(events)
        if send:
            await self.pub.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        if keep:
            self.buffer.append((self.seq, payload))
        self.seq += 1

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, buf in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        (client, b"", b"", seq.to_bytes(8, "big"), buf)
                    )
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def stored(h: int, parent: int | None, a: int) -> BlockStored:
    return BlockStored((h,), parent, (a, a), 2)


async def until(feed: KvEventFeed, cond) -> None:
    for _ in range(300):
        await feed.poll(block_ms=20)
        if cond():
            return
    raise AssertionError("never got there")


async def test_history_gaps_replay_and_a_lost_gap_reach_the_router(redis: Redis) -> None:
    pub = Publisher()
    registry = Registry(redis)
    queue: asyncio.Queue = asyncio.Queue(maxsize=100)
    await pub.publish([stored(1, None, 1)], send=False)  # before the sidecar: history
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, queue)
    tasks = [
        asyncio.create_task(sub.run()),
        asyncio.create_task(forward(queue, registry, "v1", lambda: 7.0, 1000)),
    ]
    feed = KvEventFeed(registry)
    feed.follow([FeedMember("v1", "m", 7.0)])
    try:
        await until(feed, lambda: feed.match("m", [1, 1]) == {"v1": 2})  # replayed from 0
        for _ in range(50):  # PUB drops what it sends before the SUB is connected
            if sub.received:
                break
            await pub.publish([stored(2, 1, 2)])
            await asyncio.sleep(0.05)
        await until(feed, lambda: feed.match("m", [1, 1, 2, 2]) == {"v1": 4})
        await pub.publish([stored(3, 2, 3)], send=False)  # missed on PUB, kept for replay
        await pub.publish([stored(4, 3, 4)])
        await until(feed, lambda: feed.match("m", [1, 1, 2, 2, 3, 3, 4, 4]) == {"v1": 8})
        assert sub.replayed >= 2 and sub.lost == 0 and feed.trusted("v1")
        await pub.publish([stored(5, 4, 5)], send=False, keep=False)  # gone for good
        await pub.publish([stored(6, 5, 6)])
        # Lost for good: the writer marks it, the index is rebuilt from here beside the
        # tree (tests/e2e/test_kv_gap_rebuild.py follows it to trust again).
        await until(feed, lambda: feed.streams["v1"].status == "rebuilding")
        assert sub.lost == 1 and feed.match("m", [1, 1]) == {} and not feed.trusted("v1")
        assert feed.rebuilds == {"marker": 1}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pub.close()


async def test_a_sidecar_that_missed_the_engines_start_does_not_claim_an_empty_cache(
    redis: Redis,
) -> None:
    """The engine ran before the sidecar and its replay buffer no longer holds sequence 0:
    the blocks stored then may still be cached, so the epoch starts with a resync marker
    (the router rebuilds), not an AllBlocksCleared (the router would trust an index that
    lacks them). On the code before, the first entry began with AllBlocksCleared and the
    worker was `ok` at once."""
    pub = Publisher()
    registry = Registry(redis)
    queue: asyncio.Queue = asyncio.Queue(maxsize=100)
    await pub.publish([stored(1, None, 1)], send=False, keep=False)  # rolled out of replay
    await pub.publish([stored(2, 1, 2)], send=False)  # still buffered
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, queue)
    tasks = [
        asyncio.create_task(sub.run()),
        asyncio.create_task(forward(queue, registry, "v2", lambda: 3.0, 1000, sub.complete)),
    ]
    feed = KvEventFeed(registry)
    feed.follow([FeedMember("v2", "m", 3.0)])
    try:
        await until(feed, lambda: feed.streams["v2"].status == "rebuilding")
        assert not sub.complete() and sub.first_seq == 1
        entries = await redis.xrange(registry.kv_events_key("v2"))
        first = parse_entry("v2", entries[0][1])
        assert first.seq == 0 and first.resync
        assert not any(isinstance(e, AllBlocksCleared) for e in first.batch.events)
        assert feed.rebuilds == {"marker": 1} and not feed.trusted("v2")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pub.close()
