"""The KV feed against a hostile worker credential (issue 30, findings 1, 3, 4 and 7).

Every case is a door an adversarial review opened on a live fleet; each test fails on
the code before the bound (a real Redis-protocol server, the router's own feed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis

from router.holdings.kv_feed import FeedMember, KvEventFeed
from shared.wire.kv_events import (
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    BlockStored,
    encode_batch,
    entry_fields,
)
from shared.wire.registry import Registry


def chain(first: int, n: int, parent: int | None = None) -> BlockStored:
    """`n` blocks of 2 tokens, hashes first.., token ids first.. (each block [i, i])."""
    ids = [t for i in range(first, first + n) for t in (i, i)]
    return BlockStored(tuple(range(first, first + n)), parent, ids, 2)


async def write(redis: Redis, wid: str, epoch: float, seq: int, *events: object) -> bytes:
    fields = entry_fields(wid, epoch, seq, encode_batch(list(events)))  # type: ignore[arg-type]
    return await redis.xadd(Registry(redis).kv_events_key(wid), fields)  # type: ignore[arg-type]


async def drain(feed: KvEventFeed) -> None:
    while await feed.poll():
        pass


async def test_an_oversized_entry_is_measured_in_redis_and_never_read(redis: Redis) -> None:
    """Finding 3: XREAD sent a 64 MB entry whole before the 4 MB check."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    big = entry_fields("w", 1.0, 1, b"\x00" * (MAX_BATCH_BYTES + 4096))
    await redis.xadd(Registry(redis).kv_events_key("w"), big)  # type: ignore[arg-type]
    await write(redis, "w", 1.0, 2, chain(2, 1, parent=1))
    (_, entries), = await Registry(redis).read_kv_events({"w": "0"}, 10)  # fmt: skip
    sizes = [sum(len(v) for v in fields.values()) for _, fields in entries]
    assert len(entries) == 2 and max(sizes) < 1024, sizes  # the big one came back as its size
    size = sum(len(k) + len(v if isinstance(v, bytes) else v.encode()) for k, v in big.items())
    assert entries[1][1] == {b"oversized": str(size).encode()}

    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    assert feed.dropped["oversized"] == 1
    # The hole it leaves is a gap: the worker's index is rebuilt from what follows.
    assert feed.status_of("w") == "rebuilding" and feed.match("m", [2, 2]) == {}


async def test_a_read_measures_one_oversized_entry_and_the_reader_trims_it(redis: Redis) -> None:
    """8 x 64 MB in one MULTI were copied into the read script at once (512 MB of Redis
    memory, every router's read, until 10,000 newer entries pushed them out): a read
    stops at a stream's first oversized entry, and the router that met it trims it away."""
    key = Registry(redis).kv_events_key("w")
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    for seq in range(1, 4):
        fields = entry_fields("w", 1.0, seq, b"\x00" * (MAX_BATCH_BYTES + 4096))
        await redis.xadd(key, fields)  # type: ignore[arg-type]
    await write(redis, "w", 1.0, 4, chain(2, 1, parent=1))
    (_, entries), = await Registry(redis).read_kv_events({"w": "0"}, 10)  # fmt: skip
    assert [list(f) for _, f in entries] == [
        [b"worker", b"epoch", b"seq", b"batch"],
        [b"oversized"],
    ]
    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    assert feed.dropped["oversized"] == 3 and await redis.xlen(key) == 1  # the last one left
    assert feed.status_of("w") == "rebuilding"


async def test_routers_trim_a_stream_its_worker_does_not(redis: Redis) -> None:
    for seq in range(300):
        await write(redis, "w", 1.0, seq, chain(seq + 1, 1))
    key = Registry(redis).kv_events_key("w")
    assert await redis.xlen(key) == 300
    feed = KvEventFeed(Registry(redis), stream_len=100)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await feed.reader.trim()
    assert await redis.xlen(key) < 300  # MAXLEN ~: whole macro nodes, at least 100 kept
    assert await redis.xlen(key) >= 100


async def test_the_trim_rides_on_a_read(redis: Redis) -> None:
    """A due trim goes in the read's round trip, after the read (what it trims was read
    first): no round trip of its own; one with no read to ride on (nothing readable)
    makes its own."""
    registry = Registry(redis)
    own = 0
    real_trim = registry.trim_kv_events

    async def counted(worker_ids: list[str], maxlen: int) -> None:
        nonlocal own
        own += 1
        await real_trim(worker_ids, maxlen)

    registry.trim_kv_events = counted  # type: ignore[method-assign]
    for seq in range(300):
        last = await write(redis, "w", 1.0, seq, chain(seq + 1, 1))
    key = registry.kv_events_key("w")
    feed = KvEventFeed(registry, stream_len=100, read_count=500)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await feed.poll()
    assert feed.streams["w"].cursor == last  # all 300 read, then trimmed
    assert own == 0 and 100 <= await redis.xlen(key) < 300
    feed.streams["w"].credit = -1e9  # its CPU share spent: nothing readable, no read
    feed.reader._trimmed = 0.0  # (a second later)
    task = asyncio.create_task(feed.run(lambda: [FeedMember("w", "m", 1.0, block_size=2)], 0.1))
    await asyncio.sleep(0.3)
    task.cancel()
    assert own == 1


async def test_an_old_epoch_is_dropped_before_its_batch_is_decoded(redis: Redis) -> None:
    """Finding 1: entries of an old epoch were decoded (the costly part), then dropped."""
    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w", "m", 2.0, block_size=2)])
    # An old epoch's entry whose batch is not even msgpack: never decoded, so stale.
    fields = {**entry_fields("w", 1.0, 0, b"\xc1" * 100)}
    await redis.xadd(Registry(redis).kv_events_key("w"), fields)  # type: ignore[arg-type]
    await drain(feed)
    assert feed.dropped == {"stale_epoch": 1}


async def test_entries_are_applied_with_the_event_loop_in_between(redis: Redis) -> None:
    """Finding 1: 256 entries were applied in one go, stalling /health for seconds."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    for seq in range(1, 40):
        await write(redis, "w", 1.0, seq, chain(seq + 1, 1, parent=seq))
    feed = KvEventFeed(Registry(redis), apply_budget=0.0)  # yield at every chance
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    seen = await watch(feed, lambda: feed.streams["w"].applied)
    assert feed.match("m", [1, 1, 2, 2]) == {"w": 4}
    assert len(seen) >= 40  # another task ran between entries, not only around the read


async def test_a_large_batch_is_decoded_with_the_event_loop_in_between(redis: Redis) -> None:
    """A 4 MB batch was decoded in one step (~70-300 ms: /health p99 0.2-0.8 s under the
    rejoin flood); msgpack holds the GIL, so it is decoded an event at a time instead."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    events = [chain(10_000 * (e + 1), 2_000) for e in range(30)]  # 60k blocks: ~0.5 MB
    big = await write(redis, "w", 1.0, 1, *events)
    feed = KvEventFeed(Registry(redis), apply_budget=0.0, read_count=1)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    assert await feed.poll() == 1  # the first entry
    index = feed.indexes["m"]
    # Turns of another task while the batch was read but none of it applied yet.
    state = feed.streams["w"]
    seen = await watch(feed, lambda: (state.cursor, state.applied, index.blocks_of("w")))
    assert seen.count((big, 1, 1)) >= 30
    assert index.blocks_of("w") == 1 + 60_000  # then applied whole


async def test_a_large_event_is_applied_in_pieces_with_the_loop_in_between(redis: Redis) -> None:
    """One stored event of 8,192 blocks was one index call (~30-70 ms here); applied in
    runs of RUN_BLOCKS it leaves the same index."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 8_000))
    feed = KvEventFeed(Registry(redis), apply_budget=0.0)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    seen = await watch(feed, lambda: feed.indexes["m"].blocks_of("w"))
    assert len({n for n in seen if 0 < n < 8_000}) >= 3  # other turns between the pieces
    tokens = [t for i in range(1, 8_001) for t in (i, i)]
    assert feed.match("m", tokens) == {"w": 16_000} and feed.indexes["m"].orphans == 0


async def test_an_event_of_large_blocks_is_applied_in_pieces_of_bounded_tokens(
    redis: Redis,
) -> None:
    """A heartbeat may name blocks of up to 4,096 tokens: one stored event of 1,000 such
    blocks (4M token ids, inside the 4 MB entry bound) was one run of 1,000 blocks, one
    index call of ~70-220 ms. Runs are bounded in tokens too (RUN_TOKENS): 64 blocks of
    4,096 go in pieces with the loop running between, and leave the same index."""
    bs, n = 4096, 64
    ids = [(i * 7) % 50_000 for i in range(bs * n)]
    big = BlockStored(tuple(range(1, n + 1)), None, ids, bs)
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), big)
    feed = KvEventFeed(Registry(redis), apply_budget=0.0)
    feed.follow([FeedMember("w", "m", 1.0, block_size=bs)])
    seen = await watch(feed, lambda: feed.indexes["m"].blocks_of("w"))
    assert len({k for k in seen if 0 < k < n}) >= 3  # other turns between the pieces
    assert feed.match("m", ids) == {"w": bs * n} and feed.indexes["m"].orphans == 0


async def test_a_rejoining_workers_blocks_are_dropped_in_steps(redis: Redis) -> None:
    """A new epoch (a rejoin) dropped the worker's whole share in one call: 100k+ blocks,
    ~0.1-1 s of a stalled router a second under the rejoin flood. They go in steps, and
    the worker is routed on none of them meanwhile."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 8_000))
    feed = KvEventFeed(Registry(redis), apply_budget=0.0)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    index = feed.indexes["m"]
    assert len(index) == 8_000 and feed.trusted("w")
    feed.follow([FeedMember("w", "m", 2.0, block_size=2)])  # restarted: a new epoch
    assert index.blocks_of("w") == 0 and feed.match("m", [1, 1]) == {}
    await write(redis, "w", 2.0, 0, AllBlocksCleared(), chain(50_000, 1))
    seen = await watch(feed, lambda: (len(index), tuple(feed.match("m", [1, 1]))))
    assert len({n for n, _ in seen if 0 < n < 8_000}) >= 3  # other turns between steps
    assert all(named == () for _, named in seen)
    assert len(index) == 1 and feed.match("m", [50_000, 50_000]) == {"w": 2}


async def test_a_model_nobody_serves_is_freed_in_steps(redis: Redis) -> None:
    """A model flip every second freed a model's whole index at once (finding 7's fix
    made the stall): its blocks go in steps, the loop running between."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 8_000))
    feed = KvEventFeed(Registry(redis), apply_budget=0.0)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    old = feed.indexes["m"]
    feed.follow([FeedMember("w", "flip", 1.0, block_size=2)])  # a new model field
    assert list(feed.indexes) == ["flip"]
    seen = await watch(feed, lambda: len(old))
    assert len({n for n in seen if 0 < n < 8_000}) >= 3 and len(old) == 0


async def test_a_malformed_large_batch_is_dropped_whole(redis: Redis) -> None:
    """Decoded in steps, a large batch is still applied all or nothing."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    payload = encode_batch([chain(10_000 * (e + 1), 2_000) for e in range(30)])
    cut = payload[: len(payload) - 10]  # its last event cut short
    await redis.xadd(Registry(redis).kv_events_key("w"), entry_fields("w", 1.0, 1, cut))  # type: ignore[arg-type]
    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    assert feed.dropped["malformed"] == 1 and feed.indexes["m"].blocks_of("w") == 1


async def watch(feed: KvEventFeed, state: Callable[[], object]) -> list[object]:
    """What another task saw of `state` at each of its turns while the feed read."""
    seen = []
    polling = True

    async def other_requests() -> None:
        while polling:
            seen.append(state())
            await asyncio.sleep(0)

    other = asyncio.create_task(other_requests())
    await asyncio.sleep(0)
    while await feed.poll():
        pass
    polling = False
    await other
    return list(dict.fromkeys(seen)) if all(isinstance(x, int) for x in seen) else seen


async def test_a_rejoin_or_a_model_change_reads_on_from_the_cursor(redis: Redis) -> None:
    """Finding 1: a worker that DEL-and-rewrote its hash, or changed its model field,
    made every router read its whole stream again from "0"."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    last = await write(redis, "w", 1.0, 1, chain(2, 1, parent=1))
    feed = KvEventFeed(Registry(redis))
    member = FeedMember("w", "m", 1.0, block_size=2)
    feed.follow([member])
    await drain(feed)
    assert feed.streams["w"].cursor == last
    feed.follow([])  # the hash is gone for a poll (DEL) ...
    assert "w" not in feed.streams and "m" not in feed.indexes  # (finding 7: freed)
    feed.follow([member])  # ... and back
    assert feed.streams["w"].cursor == last
    assert await feed.poll() == 0  # nothing read again
    feed.follow([FeedMember("w", "other", 1.0, block_size=2)])  # a new model field
    assert feed.streams["w"].cursor == last and await feed.poll() == 0
    assert list(feed.indexes) == ["other"]  # the old model's index is freed


async def test_block_size_comes_from_heartbeats_not_the_first_publisher(redis: Redis) -> None:
    """Finding 4: a worker that published block size 1 first made honest workers with
    their real block size untrusted until the router restarted."""
    await write(redis, "liar", 1.0, 0, AllBlocksCleared(), BlockStored((9,), None, [9], 1))
    for wid in ("a", "b"):
        await write(redis, wid, 1.0, 0, AllBlocksCleared(), chain(1, 2))
    feed = KvEventFeed(Registry(redis))
    feed.follow([
        FeedMember("liar", "m", 1.0, block_size=2),  # its heartbeat says 2, its events 1
        FeedMember("a", "m", 1.0, block_size=2),
        FeedMember("b", "m", 1.0, block_size=2),
    ])  # fmt: skip
    await drain(feed)
    assert feed.block_size("m") == 2
    assert feed.trusted("a") and feed.trusted("b") and feed.status_of("liar") == "block_size"
    assert feed.match("m", [1, 1, 2, 2]) == {"a": 4, "b": 4}
    # A heartbeat naming another size is outvoted, and not read at all.
    feed.follow([
        FeedMember("liar", "m", 1.0, block_size=1),
        FeedMember("a", "m", 1.0, block_size=2),
        FeedMember("b", "m", 1.0, block_size=2),
    ])  # fmt: skip
    assert feed.block_size("m") == 2 and "liar" not in feed.reader.readable()
    # The router's config pins it whatever the heartbeats say.
    pinned = KvEventFeed(Registry(redis), block_size=2)
    pinned.follow([FeedMember("liar", "m", 1.0, block_size=1)])
    assert pinned.block_size("m") == 2 and pinned.status_of("liar") == "block_size"


async def test_one_worker_cannot_push_the_others_out_of_the_index(redis: Redis) -> None:
    """Finding 1: one worker's 2M blocks filled the shared index (its LRU evicted the
    honest workers' blocks). Each worker holds at most its share."""
    await write(redis, "honest", 1.0, 0, AllBlocksCleared(), chain(1, 5))
    await write(redis, "flood", 1.0, 0, AllBlocksCleared(), chain(1000, 100))
    feed = KvEventFeed(Registry(redis), max_blocks=40)
    feed.follow([
        FeedMember("honest", "m", 1.0, capacity_tokens=16, block_size=2),  # 8 blocks: 16
        FeedMember("flood", "m", 1.0, capacity_tokens=16, block_size=2),
    ])  # fmt: skip
    await drain(feed)
    index = feed.indexes["m"]
    assert index.blocks_of("flood") == 16 and index.over_share == 84
    assert feed.match("m", [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]) == {"honest": 10}


async def test_a_heartbeat_that_lapses_for_a_poll_keeps_its_trust(redis: Redis) -> None:
    """A worker whose hash was missing for one poll (a stalled heartbeat) comes back as it
    was: its blocks and its trust, nothing read again (with the cursor alone it would
    wait, `syncing`, for a clear our engine may not send for a long while)."""
    for wid in ("w", "other"):
        await write(redis, wid, 1.0, 0, AllBlocksCleared(), chain(1, 2))
    feed = KvEventFeed(Registry(redis))
    members = [FeedMember(w, "m", 1.0, block_size=2) for w in ("w", "other")]
    feed.follow(members)
    await drain(feed)
    feed.follow(members[1:])
    assert feed.match("m", [1, 1, 2, 2]) == {"other": 4}  # gone: not routed to
    feed.follow(members)
    assert feed.trusted("w") and feed.match("m", [1, 1, 2, 2]) == {"w": 4, "other": 4}


async def test_a_stream_past_its_cpu_share_waits_unread(redis: Redis) -> None:
    """A worker writing more events than the router should spend its time on: past its
    share its entries wait in Redis (nothing lost) and it is routed on its tree."""
    await write(redis, "w", 1.0, 0, AllBlocksCleared(), chain(1, 1))
    for seq in range(1, 10):
        await write(redis, "w", 1.0, seq, chain(seq + 1, 1, parent=seq))
    feed = KvEventFeed(Registry(redis), cpu_share=0.0, cpu_burst=1e-9)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    assert await feed.poll() == 1  # one entry, then its credit is spent
    assert await feed.poll() == 0 and feed.status_of("w") == "lagging" and feed.reader.throttled
    feed.reader.cpu_share, feed.reader.cpu_burst = 1.0, 10.0  # the credit comes back: it reads on
    await asyncio.sleep(0.05)
    await drain(feed)
    assert feed.status_of("w") == "ok" and feed.match("m", [1, 1, 2, 2, 3, 3]) == {"w": 6}


async def test_a_model_change_keeps_the_spent_cpu_share(redis: Redis) -> None:
    """A worker that changed its model every second got a fresh CPU burst each time
    (/health p50 39 ms under the model-flip attack): its share is the worker's."""
    for seq in range(3):
        await write(
            redis, "w", 1.0, seq, *([AllBlocksCleared()] if seq == 0 else []), chain(seq + 1, 1)
        )
    feed = KvEventFeed(Registry(redis), cpu_share=0.0, cpu_burst=1e-9)
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    assert await feed.poll() == 1  # one entry, then its credit is spent
    feed.follow([FeedMember("w", "flip", 1.0, block_size=2)])
    assert await feed.poll() == 0 and feed.reader.throttled


async def test_a_medium_that_is_no_string_drops_its_entry_not_the_feed(redis: Redis) -> None:
    """A medium of another type (a list: unhashable) was a TypeError out of the decoder,
    past the feed's drop of malformed entries and out of its read; now the entry is
    dropped as malformed and the entries after it apply."""
    import msgpack

    key = Registry(redis).kv_events_key("w")
    await write(redis, "w", 1.0, 0, AllBlocksCleared())
    for seq, medium in ((1, ["GPU"]), (2, {"GPU": 1})):
        event = {"type": "BlockRemoved", "block_hashes": [1], "medium": medium}
        payload = msgpack.packb([1.0, [event]])
        await redis.xadd(key, entry_fields("w", 1.0, seq, payload))  # type: ignore[arg-type]
    await write(redis, "w", 1.0, 3, chain(1, 2))
    feed = KvEventFeed(Registry(redis))
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])
    await drain(feed)
    assert feed.dropped["malformed"] == 2
    assert feed.match("m", [1, 1, 2, 2]) == {"w": 4}
