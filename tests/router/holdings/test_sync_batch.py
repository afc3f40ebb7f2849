"""Replica sync a batch an entry (router/holdings/sync_batch.py), over a real Redis server.

A replica's flush is one stream entry of records, one zlib stream. Redis is a boundary:
each bad entry below is written with raw commands (what anyone with write access can
do), refused whole or record by record as router/holdings/sync_wire.py says, counted in
`radix_router_untrusted_rejected`, and the reader goes on with the next."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
import zlib

import pytest
from redis.asyncio import Redis

from router.holdings import sync as sync_module
from router.holdings.sync import MIN_ENTRIES, DecisionSync
from router.holdings.sync_batch import (
    FIELD,
    MAX_RECORDS,
    SyncBatchReader,
    max_batch_bytes,
    next_entry,
    pack,
    session_record,
    text_record,
    token_record,
)
from router.holdings.sync_wire import SEP, SessionEntry, decode_decision, encode_decision
from shared.config import RouterConfig
from shared.tokens.prompt_ids import token_key
from shared.wire.peers import Rejections
from shared.wire.registry import Registry
from tests.waiting import wait_until

PREFIX = "batch:"
STREAM = f"{PREFIX}decisions"
CONFIG = RouterConfig(sync=True, sync_flush_interval=0.005, sync_load_interval=0.05)
CAP = CONFIG.sync_max_chars
DIGEST = bytes(range(16))
FP = "0123456789abcdef"


def make_sync(redis: Redis, seen: list, config: RouterConfig = CONFIG) -> DecisionSync:
    sync = DecisionSync(
        redis, Registry(redis, PREFIX, Rejections()), config,
        observe=lambda w, key, now: seen.append((w, key)), local_inflight=dict,
    )  # fmt: skip
    sync.on_session = lambda entry, now: seen.append(entry)
    return sync


def record(kind: bytes, body: bytes) -> bytes:
    return struct.pack("<cI", kind, len(body)) + body


def batch(*records: bytes, replica: bytes = b"evil") -> bytes:
    return pack(replica + SEP, records)


async def replay(redis: Redis, seen: list, entries: list[dict]) -> DecisionSync:
    """A reader started after `entries` were written: it replays them."""
    for fields in entries:
        await redis.xadd(STREAM, fields)  # type: ignore[arg-type]
    sync = make_sync(redis, seen)
    await sync.start()
    await asyncio.wait_for(sync.caught_up.wait(), 10)
    await sync.stop()
    return sync


async def test_a_batch_carries_decisions_and_sessions_in_order(redis: Redis) -> None:
    a_seen: list = []
    b_seen: list = []
    a, b = make_sync(redis, a_seen), make_sync(redis, b_seen)
    await a.start()
    await b.start()
    try:
        await asyncio.wait_for(asyncio.gather(a.caught_up.wait(), b.caught_up.wait()), 5)
        a.publish("w1", "system prompt ... turn 1")
        a.publish_session("w2", DIGEST, pin_ttl=30.0, placed=False)
        a.publish("w2", "another conversation")
        await wait_until(lambda: len(b_seen) == 3)
        assert b_seen == [
            ("w1", "system prompt ... turn 1"),
            SessionEntry(DIGEST, "w2", 30.0, False),
            ("w2", "another conversation"),
        ]
        # One entry for the three: one XADD, one zlib stream.
        entries = await redis.xrange(STREAM)
        assert len(entries) == 1 and list(entries[0][1]) == [FIELD]
        assert a.published == 3 and a_seen == []
    finally:
        await a.stop()
        await b.stop()


async def test_bad_batches_are_refused_whole_and_the_reader_goes_on(redis: Redis) -> None:
    good = text_record("w2", "a real decision", CAP)
    body_cap = max_batch_bytes(CAP)
    bomb = zlib.compress(good * (200_000_000 // len(good)), 9)  # inflates to 200 MB
    assert len(bomb) < body_cap  # it passes the size check: inflating must stop it
    over = [good] * (MAX_RECORDS + 1)  # more records than a batch may hold
    whole = zlib.compress(b"".join([good, good]), 1)
    bad = [
        b"evil" + SEP + bomb,
        batch(*over),
        b"evil" + SEP + b"garbage, not zlib",
        b"evil" + SEP + whole[:-6],  # a truncated zlib stream
        batch(good[:-3]),  # a record cut off: its length runs past the batch
        batch(good + b"\x00\x01"),  # a few bytes after the last record
        b"no separator at all",
        batch(),  # no records
        b"evil" + SEP + b"x" * (body_cap + 2048),  # the field itself too large
    ]
    seen: list = []
    tracemalloc.start()
    try:
        sync = await replay(redis, seen, [{FIELD: v} for v in bad] + [{FIELD: batch(good)}])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == [("w2", "a real decision")]  # nothing of a bad batch, then the good one
    assert sync.rejections.counts["sync_decisions"] == len(bad)
    assert peak < 20_000_000, peak  # the bomb was never inflated


async def test_bad_records_are_dropped_alone(redis: Redis) -> None:
    """Inside a well-formed batch each record is checked on its own: a bad one is counted
    where its kind is (decisions, sessions) and the rest still apply."""
    records = [
        text_record("w1", "first", CAP),
        record(b"d", b"w1\r\nX" + SEP + b"bad worker id"),
        record(b"d", b"no worker id separator"),
        record(b"d", b"w1" + SEP + b"a" * (4 * CAP + 1)),  # over the key cap
        token_record("w1", [1, 2, 3], FP, CAP),  # ids on a reader that keys on text
        record(b"z", b"w1" + SEP + b"a later version's kind"),
        record(b"s", b"w1" + SEP + b"short digest"),
        record(b"s", b"w1" + SEP + DIGEST + b"k" + b"9" * 600),  # a session too large
        session_record("w3", DIGEST, 0.0, True),
        text_record("w2", "last", CAP),
    ]
    seen: list = []
    sync = await replay(redis, seen, [{FIELD: batch(*records)}])  # type: ignore[arg-type]
    assert seen == [("w1", "first"), SessionEntry(DIGEST, "w3"), ("w2", "last")]
    assert sync.rejections.counts["sync_decisions"] == 5
    assert sync.rejections.counts["sync_sessions"] == 2


async def test_old_entries_mixed_with_batches_read_in_order(redis: Redis) -> None:
    """Rolling upgrade: the versions before batches wrote an entry a decision (`d`) or a
    session (`s`); this reader applies both, and batches, in stream order."""
    old_session = b"old" + SEP + b"w4" + SEP + DIGEST + b"p0"
    entries = [
        {b"d": encode_decision(b"old" + SEP, "w1", "old text", CAP)},
        {FIELD: batch(text_record("w2", "new text", CAP))},
        {b"s": old_session},
        {b"d": b"old" + SEP + b"w1" + SEP + b"not zlib"},  # a bad old entry: counted
        {FIELD: batch(text_record("w3", "newer", CAP), session_record("w5", DIGEST, 1.5, True))},
    ]
    seen: list = []
    sync = await replay(redis, seen, entries)  # type: ignore[arg-type]
    assert seen == [
        ("w1", "old text"),
        ("w2", "new text"),
        SessionEntry(DIGEST, "w4"),
        ("w3", "newer"),
        SessionEntry(DIGEST, "w5", 1.5, True),
    ]
    assert sync.rejections.counts["sync_decisions"] == 1


def test_a_reader_before_batches_refuses_a_batch_entry_without_raising_past_it() -> None:
    """What the versions before batches do with a batch entry: their reader takes the
    field `d` (absent: b"") and decodes it, which raises the ValueError they count and
    skip (their `_apply`), so they drop it and go on; they learn nothing from it."""
    value = batch(text_record("w1", "text", CAP))
    fields = {FIELD: value}
    with pytest.raises(ValueError):
        decode_decision(fields.get(b"d", b""), CAP)
    with pytest.raises(ValueError):  # nor would the value itself pass as a decision
        decode_decision(value, CAP)


def test_the_writer_caps_entries_by_records_and_by_bytes() -> None:
    """An entry ends at MAX_RECORDS records or before its records pass the inflated
    bound, so every entry a writer makes is one every reader takes."""
    sync = DecisionSync(Redis(), Registry(Redis(), PREFIX), CONFIG, lambda *a: None, dict)
    reader = SyncBatchReader(CAP, None)
    short = [("w1", f"conversation {i}") for i in range(MAX_RECORDS + 10)]
    value, taken, records = next_entry(short, 0, sync._header, None, CAP)  # type: ignore[arg-type]
    assert (taken, records) == (MAX_RECORDS, MAX_RECORDS)
    assert len(reader.read(value)) == MAX_RECORDS
    long = [("w1", f"{i} " + "x" * CAP) for i in range(40)]  # 32 KiB each
    value, taken, records = next_entry(long, 0, sync._header, None, CAP)  # type: ignore[arg-type]
    size = len(text_record("w1", long[0][1], CAP))  # each the same
    assert taken == records < 40
    assert records * size <= max_batch_bytes(CAP) < (records + 1) * size
    assert len(reader.read(value)) == records


def test_a_repeat_of_the_last_decision_is_not_buffered_again() -> None:
    """A reader applies a flush's decisions at one time: a repeat of the decision just
    buffered would refresh nothing. Any other decision in between, or another worker,
    and it is buffered."""
    sync = DecisionSync(Redis(), Registry(Redis(), PREFIX), CONFIG, lambda *a: None, dict)
    text = "You are a helpful assistant. " * 60
    for _ in range(3):
        sync.publish("w1", text[:-1] + text[-1])  # equal, not the same object
    sync.publish("w2", text)
    sync.publish("w1", text)
    sync.publish_session("w1", DIGEST)
    sync.publish("w1", text)
    assert [item if type(item) is bytes else item[0] for item in sync._pending] == [
        "w1", "w2", "w1", session_record("w1", DIGEST, 0.0, True), "w1",
    ]  # fmt: skip


async def test_tokens_in_batches_reach_a_replica_on_the_same_tokenizer(redis: Redis) -> None:
    config = RouterConfig(sync=True, sync_flush_interval=0.005, tokenizer="sim")
    seen: list = []
    writer = DecisionSync(
        redis, Registry(redis, PREFIX), config, lambda *a: None, dict, fingerprint=FP
    )
    writer.publish("w1", [5, 6, 7])
    writer.publish("w2", "a request keyed by its text")  # sent as text: skipped on ids
    await writer.start()
    await wait_until(lambda: writer.published == 2)
    await writer.stop()
    reader = DecisionSync(
        redis, Registry(redis, PREFIX, Rejections()), config,
        lambda w, key, now: seen.append((w, key)), dict, fingerprint=FP,
    )  # fmt: skip
    await reader.start()
    await asyncio.wait_for(reader.caught_up.wait(), 5)
    await reader.stop()
    assert seen == [("w1", token_key([5, 6, 7]))]
    assert reader.skipped == 1 and not reader.rejections.counts


async def test_the_stream_keeps_about_maxlen_decisions(redis: Redis) -> None:
    """`sync_stream_maxlen` counts decisions: entries of many decisions are trimmed to
    fewer entries (never under MIN_ENTRIES), entries of one to that many entries."""
    config = RouterConfig(sync=True, sync_stream_maxlen=1000)
    sync = make_sync(redis, [], config)
    for flush in range(30):  # a busy replica: 100 decisions a flush
        for i in range(100):
            sync.publish("w1", f"flush {flush} decision {i}")
        await sync._send_pending()
    assert sync._maxlen() == MIN_ENTRIES  # 1000 decisions / ~100 an entry, floored
    assert await redis.xlen(STREAM) == 30  # under MIN_ENTRIES: nothing trimmed yet
    for i in range(1500):  # a quiet one: a decision a flush
        sync.publish("w1", f"quiet {i}")
        await sync._send_pending()
    assert 900 <= sync._maxlen() <= 1000
    # Approximate trimming keeps whole nodes of 100 entries: at most one more.
    assert await redis.xlen(STREAM) <= sync._maxlen() + 100


async def test_the_buffer_drops_the_oldest_past_its_bound_while_redis_is_away(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_module, "PENDING_MAX_CHARS", 1000)
    seen: list = []
    sync = make_sync(redis, seen)
    for i in range(30):
        sync.publish("w1", f"{i:02d}" + "x" * 98)  # 100 chars each, Redis not sent to
    assert len(sync._pending) == 10 and sync._pending_chars == 1000
    assert sync._pending[0] == ("w1", "20" + "x" * 98)  # the newest kept
    await sync._send_pending()
    reader = make_sync(redis, seen)
    await reader.start()
    await asyncio.wait_for(reader.caught_up.wait(), 5)
    await reader.stop()
    assert [key[:2] for _, key in seen] == [f"{i}" for i in range(20, 30)]
