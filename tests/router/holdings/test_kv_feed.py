"""A real sim worker's KV events, through a real Redis-protocol server, into the router's
index: what the worker's radix cache holds is what the index says it holds, after
requests, evictions, a flush and a restart; a gap or a new epoch makes it untrusted
until a resync (a gap: rebuilt beside the tree until the pool has turned over)."""

from __future__ import annotations

import asyncio

import aiohttp
from redis.asyncio import Redis

from router.holdings.feed_reader import READ_GAP_S
from router.holdings.kv_feed import FeedMember, KvEventFeed, Rebuild
from shared.redis_server import RedisServer
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    entry_fields,
    ids_text,
)
from shared.wire.registry import Registry
from tests.fuzz.conftest import start_worker, worker_config
from tests.worker.engine.test_kv_blocks import expected_keys, held_keys
from worker.http.state import ENGINE, STATE


async def settle(feed: KvEventFeed, cond, rounds: int = 200) -> None:
    for _ in range(rounds):
        await feed.poll(block_ms=20)
        if cond():
            return
    raise AssertionError("the feed never got there")


async def post(url: str, path: str, body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body or {}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_the_index_follows_a_real_workers_cache(
    redis_server: RedisServer, redis: Redis
) -> None:
    config = worker_config(
        redis_url=redis_server.url, worker_id="w1", kv_events=True, kv_events_block_size=4,
        kv_events_interval=0.01, cache_tokens=600,
    )  # fmt: skip
    server = await start_worker(config)
    app = server.app
    url = str(server.make_url("")).rstrip("/")
    cache = app[ENGINE].engine.cache
    member = FeedMember("w1", "sim", app[STATE].epoch, block_size=4)
    feed = KvEventFeed(Registry(redis))
    feed.follow([member])

    def same() -> bool:
        index = feed.indexes.get("sim")
        return index is not None and held_keys(index, "w1") == expected_keys(cache, index)

    try:
        text = "The quick brown fox jumps over the lazy dog. " * 8
        await post(url, "/v1/completions", {"prompt": text, "max_tokens": 3})
        await settle(feed, lambda: same() and feed.trusted("w1"))
        index = feed.indexes["sim"]
        assert len(held_keys(index, "w1")) >= 20
        tokens = app[ENGINE].engine.tokenizer.encode(text)
        assert feed.match("sim", tokens)["w1"] >= len(tokens) - 4
        # Other prompts until the small pool evicts the first: the index drops it too.
        for i in range(12):
            await post(
                url, "/v1/completions", {"prompt": f"{i} other words " * 20, "max_tokens": 2}
            )
        await settle(feed, same)
        assert feed.match("sim", tokens).get("w1", 0) < len(tokens) - 4
        # A flush empties both.
        await post(url, "/flush_cache")
        await settle(feed, lambda: same() and not held_keys(feed.indexes["sim"], "w1"))
        assert feed.dropped == {}
    finally:
        await server.close()


async def test_a_gap_rebuilds_until_a_clear_and_a_new_epoch_resets(redis: Redis) -> None:
    registry = Registry(redis)
    feed = KvEventFeed(registry)
    feed.follow([FeedMember("w2", "m", 5.0, block_size=2)])

    async def write(epoch: float, seq: int, *events) -> None:
        await registry.append_kv_events("w2", epoch, seq, encode_batch(events), 1000)

    block = BlockStored((11,), None, (1, 2), 2)
    await write(5.0, 0, AllBlocksCleared(), block)
    await settle(feed, lambda: feed.trusted("w2"))
    assert feed.match("m", [1, 2, 3]) == {"w2": 2}
    await write(5.0, 2, BlockStored((12,), None, (3, 4), 2))  # seq 1 is missing
    # Rebuilt from after the gap: what came before is forgotten (seq 1 may have removed
    # it), what follows is held, and the worker is not trusted alone (its tree counts).
    await settle(feed, lambda: feed.streams["w2"].status == "rebuilding")
    assert feed.match("m", [1, 2]) == {} and feed.dropped["gap"] == 1
    assert feed.match("m", [3, 4]) == {"w2": 2} and not feed.trusted("w2")
    assert feed.rebuilds == {"gap": 1}
    await write(5.0, 3, AllBlocksCleared(), BlockStored((13,), None, (5, 6), 2))
    await settle(feed, lambda: feed.trusted("w2"))
    assert feed.match("m", [1, 2]) == {} and feed.match("m", [5, 6]) == {"w2": 2}
    # The heartbeat names a newer epoch: untrusted until its entries come.
    feed.follow([FeedMember("w2", "m", 6.0, block_size=2)])
    assert feed.streams["w2"].status == "stale" and feed.match("m", [5, 6]) == {}
    await write(5.0, 4, BlockStored((14,), None, (7, 8), 2))  # the old epoch: dropped
    await write(6.0, 0, AllBlocksCleared(), BlockStored((21,), None, (7, 8), 2))
    await settle(feed, lambda: feed.trusted("w2"))
    assert feed.dropped["stale_epoch"] == 1
    assert feed.match("m", [7, 8]) == {"w2": 2} and feed.match("m", [5, 6]) == {}
    # A worker that leaves the fleet leaves the index.
    feed.follow([])
    assert feed.match("m", [7, 8]) == {} and not feed.streams
    assert entry_fields("w2", 1.0, 0, b"")["worker"] == "w2"


async def test_a_lagging_reader_untrusts_until_caught_up(redis: Redis) -> None:
    registry = Registry(redis)
    now = [0.0]
    feed = KvEventFeed(registry, read_count=2, max_lag=1.0, clock=lambda: now[0])
    feed.follow([FeedMember("w3", "m", 1.0, block_size=2)])
    for seq in range(5):
        events = [AllBlocksCleared()] if seq == 0 else []
        events.append(BlockStored((100 + seq,), None if seq == 0 else 99 + seq, (seq, seq), 2))
        await registry.append_kv_events("w3", 1.0, seq, encode_batch(events), 1000)
    now[0] = 10**10  # the entries' ids are far in the past
    await feed.poll()
    await feed.poll()
    assert feed.streams["w3"].status == "lagging" and feed.match("m", [0, 0]) == {}
    await feed.poll()  # the last, short read: caught up
    assert feed.trusted("w3") and feed.match("m", [0, 0, 1, 1, 2, 2]) == {"w3": 6}
    await asyncio.sleep(0)


def test_a_rebuilding_worker_scores_on_its_index_and_its_tree() -> None:
    """Rebuilding: the index (blocks stored since the loss) and the tree's entries, old
    ones included, both count; trusted again, the index replaces old tree entries."""
    from router.holdings.merge import KvScorer

    feed = KvEventFeed(None)  # type: ignore[arg-type]  # entries applied directly
    feed.follow([FeedMember("w", "m", 1.0, capacity_tokens=4, block_size=2)])  # a pool of 2 blocks

    def apply(seq: int, *events, resync: bool = False) -> None:
        fields = entry_fields("w", 1.0, seq, encode_batch(events), resync)
        feed.apply_entry("w", {k.encode(): v if isinstance(v, bytes) else v.encode()
                               for k, v in fields.items()})  # fmt: skip

    apply(0, AllBlocksCleared(), BlockStored((1,), None, (1, 2), 2))
    apply(2, BlockStored((3,), None, (3, 4), 2))  # seq 1 lost
    assert feed.status_of("w") == "rebuilding"
    scorer = KvScorer(feed, inflight=2.0)
    tree = [({"w": 0.0}, 6)]  # the tree: w was sent 6 tokens of this prompt, long ago
    prompt = [3, 4, 5, 6, 7, 8]
    assert scorer.correct(tree, prompt, "m", 6, now=100.0) == [({"w": 100.0}, 6)]
    apply(3, BlockRemoved((1,)), BlockRemoved((9,), "CPU"))
    assert feed.rebuild_of("w") == Rebuild(removed=1, needed=2)
    apply(4, BlockRemoved((8,)))  # the pool (2 blocks) has turned over
    assert feed.status_of("w") == "ok" and feed.rebuild_of("w") is None
    # Trusted alone: the old tree entry yields to what the worker reports holding.
    assert scorer.correct(tree, prompt, "m", 6, now=100.0) == [({"w": 100.0}, 2)]
    # A resync marker with no hole before it (a reader that missed nothing) rebuilds too.
    apply(5, resync=True)
    assert feed.status_of("w") == "rebuilding" and feed.rebuilds == {"gap": 1, "marker": 1}
    apply(6, AllBlocksCleared())  # the engine cleared its cache: a known state
    assert feed.status_of("w") == "ok"


def test_token_ids_that_are_not_token_ids_drop_their_entry() -> None:
    """An event's token ids are checked in C (shared/wire/kv_events.py `_check_ids`): an id
    past 31 bits, a negative one, a float, a string or a list drops the whole entry as
    malformed; the entries around it still apply."""
    import msgpack

    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # entries applied by hand
    feed.follow([FeedMember("w", "m", 1.0, block_size=2)])

    def stored(ids: list, seq: int) -> dict[bytes, bytes]:
        event = {"type": "BlockStored", "block_hashes": [seq + 100], "parent_block_hash": None,
                 "token_ids": ids, "block_size": 2, "lora_id": None, "medium": None}  # fmt: skip
        payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}, event]])
        fields = entry_fields("w", 1.0, seq, payload)
        return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}

    bad = [[1, 2**31], [1, -1], [1, -(2**31)], [1, 2.0], [1, "2"], [1, [2]], [1, None], [1, 2**63]]
    feed.apply_entry("w", stored([5, 6], 0))
    for seq, ids in enumerate(bad, start=1):
        feed.apply_entry("w", stored(ids, seq))
    feed.apply_entry("w", stored([2**31 - 1, 0], len(bad) + 1))
    assert feed.dropped["malformed"] == len(bad)
    assert feed.match("m", [2**31 - 1, 0]) == {"w": 2}


def test_a_decoded_event_keys_its_blocks_from_the_text_its_check_packed() -> None:
    """The decoder packs a stored event's ids to check them; the packed ids, as key
    text, are what the index keys the blocks from (no list of ints walked per block).
    The index answers as it does for the same event without that text, whole or in the
    feed's pieces (each piece's text the slice of its own ids)."""
    import msgpack

    from router.holdings.feed_entries import RUN_BLOCKS, block_pieces
    from router.holdings.kv_index import BlockIndex

    n = RUN_BLOCKS + 52  # blocks: two pieces
    ids = [(i * 7919) % 50_000 for i in range(4 * n)]
    wire = {"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "parent_block_hash": None,
            "token_ids": ids, "block_size": 4, "lora_id": None, "medium": None}  # fmt: skip
    array = ["BlockStored", list(range(1, n + 1)), None, ids, 4, None, None]
    for raw in (wire, array):
        (event,) = decode_batch(msgpack.packb([1.0, [raw]])).events
        assert isinstance(event, BlockStored) and event.token_text == ids_text(ids)
        plain = BlockStored(event.block_hashes, None, ids, 4, event.medium)
        pieces = list(block_pieces(event))
        assert len(pieces) == 2 and all(p.token_text == ids_text(p.token_ids) for p in pieces)  # type: ignore[union-attr]
        answers = []
        for events in ([event], [plain], pieces):
            index = BlockIndex(4)
            index.apply("w", events)
            answers.append([index.match_tiers(ids[:k]) for k in (4, 60, 4 * n)])
        assert answers[0] == answers[1] == answers[2] == [{"w": (k, k)} for k in (4, 60, 4 * n)]


def count_reads(registry: Registry) -> list[int]:
    """`registry.read_kv_events` wrapped to count its calls: [reads so far]."""
    reads = [0]
    real_read = registry.read_kv_events

    async def counted(*args: object, **kwargs: object) -> object:
        reads[0] += 1
        return await real_read(*args, **kwargs)  # type: ignore[arg-type]

    registry.read_kv_events = counted  # type: ignore[method-assign]
    return reads


async def test_reads_are_paced_by_what_they_find(redis: Redis) -> None:
    """`KvEventFeed.run`: an empty read waits twice as long as the last wait (up to the
    feed's idle) and a read that drained the streams waits for a route's question (the
    next test) or the idle, so an idle router makes a few Redis round trips a second, not
    one every 50 ms (~20), while what a busy writer appends every 50 ms is still applied,
    in few reads."""
    registry = Registry(redis)
    feed = KvEventFeed(registry)
    reads = count_reads(registry)
    member = FeedMember("w", "m", 1.0, block_size=2)
    task = asyncio.create_task(feed.run(lambda: [member], idle=0.4))
    try:
        await asyncio.sleep(1.5)  # nothing written: 0.1, 0.2, 0.4, 0.4 ... between reads
        assert 1 <= reads[0] <= 7, reads[0]  # (a loaded machine only reads less)
        reads[0] = 0
        key = registry.kv_events_key("w")
        await redis.xadd(key, entry_fields("w", 1.0, 0, encode_batch([AllBlocksCleared()])))
        for seq in range(1, 21):  # a busy writer: an entry every 50 ms for a second
            stored = BlockStored((seq,), None, (seq, seq), 2)
            await redis.xadd(key, entry_fields("w", 1.0, seq, encode_batch([stored])))
            await asyncio.sleep(0.05)
        for _ in range(100):
            if feed.match("m", [20, 20]):
                break
            await asyncio.sleep(0.05)
        assert feed.match("m", [20, 20]) == {"w": 2} and feed.trusted("w")
        assert feed.streams["w"].applied == 21
        assert reads[0] <= 12, reads[0]  # a read every 50 ms would be 20 or more
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_routes_question_starts_the_next_read(redis: Redis) -> None:
    """After a read that found entries, the next one starts when a route asks the index
    (`match_tiers`) READ_GAP_S or more after that read began, in the same turn of the event
    loop, not from a timer of its own; asked sooner, it waits for a later question; asked
    by nobody, it waits the feed's idle (here 5 s: no read at all meanwhile)."""
    registry = Registry(redis)
    feed = KvEventFeed(registry)
    reads = count_reads(registry)
    key = registry.kv_events_key("w")

    async def write(seq: int, *events: object) -> None:
        await redis.xadd(key, entry_fields("w", 1.0, seq, encode_batch(list(events))))

    async def until(cond: object, seconds: float) -> bool:
        for _ in range(int(seconds / 0.01)):
            if cond():  # type: ignore[operator]
                return True
            await asyncio.sleep(0.01)
        return False

    await write(0, AllBlocksCleared())
    await write(1, BlockStored((1,), None, (1, 1), 2))
    member = FeedMember("w", "m", 1.0, block_size=2)
    task = asyncio.create_task(feed.run(lambda: [member], idle=5.0))
    try:
        assert await until(lambda: "w" in feed.streams and feed.streams["w"].applied == 2, 3)
        first = reads[0]
        await write(2, BlockStored((2,), 1, (2, 2), 2))
        await asyncio.sleep(READ_GAP_S + 0.1)
        assert reads[0] == first  # nobody asked: no read before the idle (5 s)
        assert feed.match("m", [1, 1, 2, 2]) == {"w": 2}  # (not a question: no read)
        feed.match_tiers("m", [1, 1, 2, 2])  # a route's question, the read due: it starts
        assert await until(lambda: feed.streams["w"].applied == 3, 1), reads[0]
        assert reads[0] == first + 1
        await write(3, BlockStored((3,), 2, (3, 3), 2))
        feed.match_tiers("m", [1, 1])  # asked within READ_GAP_S of that read: it waits
        await asyncio.sleep(0.05)
        assert reads[0] == first + 1 and feed.streams["w"].applied == 3
        await asyncio.sleep(READ_GAP_S)
        feed.match_tiers("m", [1, 1])  # asked again once it is due
        assert await until(lambda: feed.streams["w"].applied == 4, 1), reads[0]
        assert reads[0] == first + 2
        feed.stop()  # waiting for a question: it ends at once, not after the idle
        await asyncio.wait([task], timeout=1)
        assert task.done() and task.exception() is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_stopped_feed_ends_its_loop_without_a_cancel(redis: Redis) -> None:
    """`stop` ends `run` at its next turn, reading no more: the app sets it before it
    cancels the task, since a cancel that meets redis-py's own timeout can be lost
    (shared/serving/aio.py `stop_task`) and the loop would read on until the app gave
    up waiting for it."""
    registry = Registry(redis)
    feed = KvEventFeed(registry)
    member = FeedMember("w", "m", 1.0, block_size=2)
    task = asyncio.create_task(feed.run(lambda: [member], idle=0.05))
    try:
        for _ in range(100):
            if "w" in feed.streams:
                break
            await asyncio.sleep(0.01)
        assert "w" in feed.streams and not task.done()
        feed.stop()
        await asyncio.wait([task], timeout=2)
        assert task.done() and task.exception() is None  # ended, not cancelled
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
