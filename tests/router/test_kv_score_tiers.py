"""A host-held block is worth less than a device-held one and more than a miss.

The real feed and index (router/fleet/kv_feed.py, kv_index.py) fed stream entries in the
wire form, and the real scorer (router/policy/kv_score.py) over them; no Redis needed
(entries are applied as the reader applies them)."""

from __future__ import annotations

import math

from router.fleet.kv_feed import FeedMember, KvEventFeed
from router.policy.kv_score import HOST_HIT_WEIGHT, KvScorer, host_hit_weight
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
    entry_fields,
)
from shared.wire.registry import WorkerRecord

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks
HASHES = (11, 12, 13, 14)


def entry(wid: str, seq: int, events: list[KVEvent]) -> dict[bytes, bytes]:
    raw = entry_fields(wid, 1.0, seq, encode_batch(events))
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}


def feed_of(events: dict[str, list[list[KVEvent]]]) -> KvEventFeed:
    feed = KvEventFeed(None)  # type: ignore[arg-type]  # no reader: entries applied by hand
    feed.follow([FeedMember(w, "m", 1.0) for w in events])
    for wid, batches in events.items():
        for seq, batch in enumerate(batches):
            feed.apply_entry(wid, entry(wid, seq, batch))
    return feed


def stored(n: int, medium: str) -> BlockStored:
    return BlockStored(HASHES[:n], None, TOKENS[: n * BS], BS, medium)


def test_a_demoted_prefix_is_held_on_the_host_and_a_host_drop_forgets_it() -> None:
    feed = feed_of({
        "dev": [[AllBlocksCleared(), stored(4, "GPU")]],
        # demoted: the last two blocks stored on the host, then removed from the device
        "mixed": [[AllBlocksCleared(), stored(4, "GPU")],
                  [stored(4, "CPU"), BlockRemoved(HASHES[2:], "GPU")]],
        "gone": [[AllBlocksCleared(), stored(4, "GPU")],
                 [stored(4, "CPU"), BlockRemoved(HASHES, "GPU")],
                 [BlockRemoved(HASHES, "CPU")]],
    })  # fmt: skip
    assert feed.match_tiers("m", TOKENS) == {"dev": (16, 16), "mixed": (8, 16)}
    assert feed.match("m", TOKENS) == {"dev": 16, "mixed": 16}  # held in some tier


def test_scores_a_host_tail_between_a_device_hit_and_a_miss() -> None:
    feed = feed_of({
        "dev": [[AllBlocksCleared(), stored(4, "GPU")]],
        "host": [[AllBlocksCleared(), stored(4, "GPU")],
                 [stored(4, "CPU"), BlockRemoved(HASHES, "GPU")]],
        "none": [[AllBlocksCleared()]],
    })  # fmt: skip
    weights = {"host": 0.75}
    scorer = KvScorer(feed, inflight=2.0, host_weight=lambda w: weights.get(w, 0.0))
    text_len = 64  # 4 chars a token
    path = scorer.correct([], TOKENS, "m", text_len, now=10.0)
    ends = {w: max(e for held, e in path if w in held) for w in ("dev", "host")}
    assert ends == {"dev": 64, "host": 48}  # 16 host tokens at 0.75 of a device token
    assert not any("none" in held for held, _ in path)
    weights["host"] = 0.0  # host-held blocks as misses: the GPU-only view
    path = scorer.correct([], TOKENS, "m", text_len, now=10.0)
    assert not any("host" in held for held, _ in path)


def record(**kw: object) -> WorkerRecord:
    return WorkerRecord("w", "http://127.0.0.1:1", "m", "sim", 1.0, **kw)  # type: ignore[arg-type]


def test_host_weight_from_the_workers_figures() -> None:
    sim = record(kv_bytes_per_token=131_072, host_load_bytes_per_s=25e9, prefill_us_per_token=100)
    assert math.isclose(host_hit_weight(sim, 50.0), 1 - 131_072 / 25e9 * 1e6 / 100)
    # No prefill figure: the configured one; no load figures or garbage: the default.
    no_prefill = record(kv_bytes_per_token=131_072, host_load_bytes_per_s=25e9)
    assert math.isclose(host_hit_weight(no_prefill, 50.0), 1 - 5.24288 / 50)
    assert host_hit_weight(record(), 50.0) == HOST_HIT_WEIGHT
    assert host_hit_weight(None, 50.0) == HOST_HIT_WEIGHT
    slow = record(kv_bytes_per_token=10**8, host_load_bytes_per_s=1.0, prefill_us_per_token=1)
    assert host_hit_weight(slow, 50.0) == 0.0  # loading costs more than computing: a miss
    for bad in (float("nan"), -1.0, 1e30):
        r = record(kv_bytes_per_token=131_072, host_load_bytes_per_s=bad)
        assert host_hit_weight(r, 50.0) == HOST_HIT_WEIGHT


def test_a_dropped_worker_holds_nothing_in_any_tier() -> None:
    """Dropping a worker (cleared, restarted, gone) forgets its host copies too."""
    feed = feed_of({"w": [[AllBlocksCleared(), stored(4, "GPU")]]})
    index = feed.indexes["m"]
    index.apply("w", [BlockStored(HASHES, None, (), 0, "CPU")])  # host copies of all four
    assert feed.match_tiers("m", TOKENS) == {"w": (16, 16)}
    index.drop_worker("w")
    assert feed.match_tiers("m", TOKENS) == {} and len(index) == 0


def test_an_orphan_block_is_dropped_and_never_matched() -> None:
    """A store whose parent the index does not know is counted and dropped: its blocks
    must not stand under the root, where a prompt starting with their tokens would match."""
    from router.fleet.kv_index import BlockIndex

    index = BlockIndex(4)
    index.apply("w", [BlockStored((7, 8), 999, TOKENS[:8], 4)])  # 999: never stored
    assert index.orphans == 2 and index.blocks_of("w") == 0
    assert index.match(TOKENS[:8]) == {}
    index.apply("w", [BlockStored((1, 2), None, TOKENS[:8], 4)])  # the same tokens, rooted
    assert index.match(TOKENS[:8]) == {"w": 8}


def test_vllm_offloading_stores_by_hash_only_mark_known_blocks_host_held() -> None:
    """vLLM's offloading connector (unless its events are "self-describing") announces a
    block copied to its CPU tier by hash alone: block_size 0, no token ids, no parent.
    It marks a block the worker named before as host-held; an unknown hash is an orphan;
    anything else tokenless stays malformed."""
    import msgpack
    import pytest

    from shared.wire.kv_events import decode_batch

    def vllm_placeholder(h: int) -> dict[str, object]:  # as vLLM 0.32's events.py writes it
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
                "lora_name": None, "group_idx": 0, "locality": None, "ownership": None}  # fmt: skip

    batch = decode_batch(msgpack.packb([1.0, [vllm_placeholder(13), vllm_placeholder(99)]]))
    assert [(e.block_size, len(e.token_ids), e.medium) for e in batch.events] == [
        (0, 0, "CPU"),
        (0, 0, "CPU"),
    ]
    feed = feed_of({"w": [[AllBlocksCleared(), stored(4, "GPU")]]})
    index = feed.indexes["m"]
    index.apply("w", batch.events)  # 13 (the third block) known; 99 not
    assert index.orphans == 1
    index.apply("w", [BlockRemoved(HASHES[2:], "GPU")])  # the device evicts blocks 3 and 4
    assert feed.match_tiers("m", TOKENS) == {"w": (8, 12)}  # block 3 is on the host still
    for bad in ({"token_ids": [1, 2]}, {"parent_block_hash": 11}):
        with pytest.raises(ValueError, match="token_ids"):
            decode_batch(msgpack.packb([1.0, [{**vllm_placeholder(13), **bad}]]))


def test_an_older_entry_the_index_confirms_keeps_its_end_discounted_on_the_host() -> None:
    """The tree's older entry (past the in-flight window) that the index confirms keeps its
    exact end (kv_score.py); the part of it held only on the host counts at the weight."""
    feed = feed_of({
        "dev": [[AllBlocksCleared(), stored(4, "GPU")]],
        "host": [[AllBlocksCleared(), stored(4, "GPU")],
                 [stored(4, "CPU"), BlockRemoved(HASHES[2:], "GPU")]],
    })  # fmt: skip
    scorer = KvScorer(feed, inflight=2.0, host_weight=lambda w: 0.5)
    old_entry = [({"dev": 1.0, "host": 1.0}, 66)]  # 66 chars: a block's partial tail too
    path = scorer.correct(old_entry, TOKENS, "m", text_len=66, now=10.0)
    ends = {w: max(e for held, e in path if w in held) for w in ("dev", "host")}
    # 16 tokens at 66/16 chars each: the first 8 on the device (33 chars), the rest on the
    # host at half their worth (33 / 2)
    assert ends == {"dev": 66, "host": round(33 + 0.5 * 33)}


def test_copies_stored_twice_in_a_tier_are_counted_per_tier() -> None:
    # The index counts a second store only where a block is stored again in a tier that
    # already holds it (kv_index._WorkerBlocks.extra): each tier's copies go one by one.
    twice = [AllBlocksCleared(), stored(4, "GPU"), stored(4, "GPU"), stored(2, "CPU")]
    steps = [
        ([BlockRemoved(HASHES, "GPU")], (16, 16)),  # one GPU copy left of each block
        ([BlockRemoved(HASHES[:2], "CPU")], (16, 16)),  # the host copy gone, GPU stays
        ([BlockRemoved(HASHES[2:], "GPU")], (8, 8)),  # the tail's last copies gone
        ([stored(2, "CPU"), BlockRemoved(HASHES[:2], "GPU")], (0, 8)),  # host-held only
    ]
    batches = [twice]
    for events, expected in steps:
        batches.append(events)
        feed = feed_of({"w": batches})
        assert feed.match_tiers("m", TOKENS) == {"w": expected}
    assert feed.lost_at("m", TOKENS, "w", 8) > -math.inf  # the tail was lost, not cleared
    feed = feed_of({"w": [*batches, [BlockRemoved(HASHES[:2], "CPU")]]})
    assert feed.match_tiers("m", TOKENS) == {}
