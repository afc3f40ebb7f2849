"""Replica sync on prompt ids (router/holdings/sync_wire.py), over a real Redis server.

With a `tokenizer` the routers' trees key on token ids, so decisions travel as ids,
stamped with the tokenizer's fingerprint. Redis is a boundary: every entry below is
written with raw commands (what anyone with write access can do) and each bad one is
dropped and counted in `radix_router_untrusted_rejected{source="sync_decisions"}`."""

from __future__ import annotations

import asyncio
import tracemalloc
import zlib

import numpy as np
import pytest
from redis.asyncio import Redis

from router.holdings.sync import SEP, DecisionSync
from router.holdings.sync_batch import next_entry
from router.holdings.sync_wire import TOKENS, decode_decision, encode_decision, encode_tokens
from shared.config import RouterConfig
from shared.tokens.fingerprint import FINGERPRINT_LEN, tokenizer_fingerprint
from shared.tokens.prompt_ids import TokenKey, token_key
from shared.tokens.prompt_tokens import load_tokenizer
from shared.wire.peers import Rejections
from shared.wire.registry import Registry
from tests.waiting import wait_until

PREFIX = "tok:"
CONFIG = RouterConfig(sync=True, sync_flush_interval=0.005, sync_load_interval=0.05)
FP = tokenizer_fingerprint(load_tokenizer("sim"))
OTHER = "0123456789abcdef"  # another tokenizer's fingerprint
assert OTHER != FP


def make_sync(redis: Redis, seen: list, fingerprint: str | None = FP) -> DecisionSync:
    return DecisionSync(
        redis, Registry(redis, PREFIX, Rejections()), CONFIG,
        observe=lambda w, key, now: seen.append((w, key)), local_inflight=dict,
        fingerprint=fingerprint,
    )  # fmt: skip


def test_fingerprint_names_the_tokenizer_not_its_path(tiny_model_dir: object) -> None:
    assert len(FP) == FINGERPRINT_LEN
    assert tokenizer_fingerprint(load_tokenizer("sim")) == FP  # deterministic
    assert tokenizer_fingerprint(load_tokenizer(str(tiny_model_dir))) != FP


def test_token_entries_round_trip_compactly() -> None:
    ids = np.arange(40_000, 42_000, dtype=np.int64)  # a 2k-token prompt
    entry = encode_tokens(b"r1" + SEP, "w1", ids, FP, CONFIG.sync_max_chars)
    worker, key = decode_decision(entry, CONFIG.sync_max_chars, FP)
    assert (worker, type(key), key.ids()) == ("w1", TokenKey, ids.tolist())
    assert key == token_key(ids)  # the tree's key, as the writer's tree keyed it
    assert len(entry) < 4 * len(ids)  # zlib of 4 bytes an id
    capped = encode_tokens(b"r1" + SEP, "w1", list(range(100)), FP, 64)
    assert decode_decision(capped, 64, FP)[1].ids() == list(range(64))  # type: ignore[union-attr]
    # A TokenKey is written as it is: the same bytes as its ids.
    assert encode_tokens(b"r1" + SEP, "w1", token_key(ids), FP, 10_000) == entry  # type: ignore[arg-type]
    # The text entries of the version before tokens still read as text.
    old = b"r0" + SEP + b"w2" + SEP + zlib.compress(b"a conversation")
    assert decode_decision(old, CONFIG.sync_max_chars, FP) == ("w2", "a conversation")
    text = encode_decision(b"r0" + SEP, "w2", "a conversation", 64)
    assert (
        decode_decision(text, 64, FP) == decode_decision(text, 64, None) == ("w2", "a conversation")
    )
    # A reader of the version before tokens (zlib only) refuses a token payload instead
    # of inserting garbage text: `T` is no zlib header.
    with pytest.raises(zlib.error):
        zlib.decompress(entry.split(SEP, 2)[2])


def test_a_clients_out_of_range_ids_are_not_shared_and_never_raise(redis_server) -> None:
    """A token-id prompt is the client's: ids past uint32 made numpy raise on the request
    path (publish runs inside routing)."""
    redis = Redis.from_url(redis_server.url)
    sync = make_sync(redis, [])
    for ids in ([2**40], [2**70], [-1], [2**31], [], [[1, 2]], ["x"]):
        sync.publish("w1", ids)  # type: ignore[arg-type]
    assert not sync._pending
    sync.publish("w1", [2**31 - 1, 0])
    assert len(sync._pending) == 1
    # A router on ids keys a request it has no ids for by its text's bytes (room.py):
    # not ids where a byte is past 0x7f in an id's top byte, or not 4 a token. Not shared
    # (every replica would refuse it: the flush leaves it out), never raised on.
    for text in ("abcéxyz", "ünïcödé text!!", "abc"):  # a top byte 0xc3; 18 bytes; 3
        room_key = TokenKey(text.encode().decode("latin-1"))
        sync.publish("w1", room_key)
    items = list(sync._pending)
    value, taken, records = next_entry(items, 0, sync._header, FP, CONFIG.sync_max_chars)
    assert (taken, records) == (len(items), 1) and value is not None


async def test_tokens_reach_the_other_replica_and_text_entries_are_skipped(
    redis: Redis,
) -> None:
    a_seen: list = []
    b_seen: list = []
    a, b = make_sync(redis, a_seen), make_sync(redis, b_seen)
    await a.start()
    await b.start()
    try:
        await asyncio.wait_for(asyncio.gather(a.caught_up.wait(), b.caught_up.wait()), 5)
        a.publish("w1", np.array([5, 6, 7, 8], dtype=np.int64))
        # An old replica's text decision (rolling upgrade): read, not applied, no error.
        await redis.xadd(
            f"{PREFIX}decisions", {"d": b"old" + SEP + b"w2" + SEP + zlib.compress(b"hi")}
        )
        a.publish("w3", [9, 10])
        await wait_until(
            lambda: b_seen == [("w1", token_key([5, 6, 7, 8])), ("w3", token_key([9, 10]))]
        )
        assert all(type(key) is TokenKey for _, key in b_seen)
        assert b.skipped == 1 and b.rejections.counts.get("sync_decisions", 0) == 0
    finally:
        await a.stop()
        await b.stop()


async def test_bad_token_entries_are_dropped_counted_and_the_reader_goes_on(
    redis: Redis,
) -> None:
    seen: list = []
    stream = f"{PREFIX}decisions"
    cap = CONFIG.sync_max_chars

    def tok(payload: bytes, fp: str = FP, worker: bytes = b"w1") -> bytes:
        return b"evil" + SEP + worker + SEP + TOKENS + fp.encode() + b":" + payload

    good = np.array([1, 2, 3], dtype="<u4").tobytes()
    bomb = zlib.compress(b"\x01" * 200_000_000, 9)  # ≈ 200 KB that inflates to 200 MB
    bad = [
        tok(zlib.compress(good), OTHER),  # another tokenizer: must not reach the tree
        tok(zlib.compress(good), "short"),  # a fingerprint of the wrong length
        tok(zlib.compress(b"\x01\x02\x03")),  # not a whole number of ids
        tok(zlib.compress(b"")),  # no ids
        tok(zlib.compress(np.array([2**31], dtype="<u4").tobytes())),  # id out of range
        tok(zlib.compress(np.array([5, 0xDC00D800], dtype="<u4").tobytes())),  # the last id
        tok(zlib.compress(b"\x00" * (4 * cap + 4))),  # over the cap once inflated
        tok(bomb[: 4 * cap]),  # a bomb cut to fit the entry: inflates past the cap
        tok(b"not zlib"),
        tok(zlib.compress(good), worker=b"w1\r\nX"),  # a worker id of the wrong shape
        tok(b"\x00" * (8 * cap)),  # the entry itself too large
    ]
    for entry in [*bad, tok(zlib.compress(good), worker=b"w2")]:
        await redis.xadd(stream, {"d": entry})
    sync = make_sync(redis, seen)
    text_reader: list = []
    plain = make_sync(redis, text_reader, fingerprint=None)  # a router without a tokenizer
    tracemalloc.start()
    try:
        await sync.start()
        await plain.start()
        await asyncio.wait_for(asyncio.gather(sync.caught_up.wait(), plain.caught_up.wait()), 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await sync.stop()
        await plain.stop()
    assert seen == [("w2", token_key([1, 2, 3]))]  # the one good entry, and no more
    assert sync.rejections.counts["sync_decisions"] == len(bad)
    # A text tree takes no ids at all: every token entry is refused and counted.
    assert text_reader == []
    assert plain.rejections.counts["sync_decisions"] == len(bad) + 1
    assert peak < 20_000_000, peak  # the bomb was never inflated


def test_the_wire_bench_runs_both_arms(capsys) -> None:
    from loadtests.__main__ import main

    argv = ["sync-wire", "--sessions", "2", "--turns", "2", "--words", "50", "--rounds", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| text |" in out and "| tokens |" in out and "tokens / text" in out
