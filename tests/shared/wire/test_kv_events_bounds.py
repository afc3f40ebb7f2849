"""A KV-event batch from a hostile writer (a worker's stream, an engine's ZMQ socket):
`decode_batch` and the stepwise `BatchReader` (router/holdings/feed_entries.py decodes a
large batch an event at a time) refuse the same payloads with ValueError, before the
work where a size says so. Each case is a bound; shared/wire/kv_schema.py's MAX_
constants name them."""

from __future__ import annotations

import msgpack
import pytest

from shared.wire.kv_events import (
    MAX_BATCH_BYTES,
    MAX_BLOCKS,
    MAX_EVENT_TOKENS,
    MAX_EVENTS,
    BatchReader,
    BlockStored,
    decode_batch,
    encode_batch,
)


def stored(n_blocks: int, bs: int) -> dict[str, object]:
    return {
        "type": "BlockStored", "block_hashes": list(range(1, n_blocks + 1)),
        "parent_block_hash": None, "token_ids": [7] * (n_blocks * bs), "block_size": bs,
        "medium": "GPU",
    }  # fmt: skip


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD = pack([1.0, [stored(2, 4)]])

HOSTILE = {
    "trailing_bytes": GOOD + b"\x00" * 10,
    "two_batches": GOOD + GOOD,
    "four_items": pack([1.0, [], 0, 0]),
    "ts_a_bool": pack([True, []]),
    "ts_a_string": pack(["1.0", []]),
    "events_past_max_events": pack([1.0, [{"type": "AllBlocksCleared"}] * (MAX_EVENTS + 1)]),
    "cut_short": GOOD[:-3],
    "deep_nesting": b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\xc0",
    # One event of 4M token ids in 4,096-token blocks fits in 4 MB (1 byte an id): one
    # decode step of ~140-200 ms. Refused at its array header, before any id is read.
    "event_tokens_past_bound": pack([1.0, [stored(MAX_EVENT_TOKENS // 4096 + 1, 4096)]]),
    "hashes_past_max_blocks": pack([1.0, [stored(MAX_BLOCKS + 1, 1)]]),
    "long_string": pack([1.0, [{"type": "x" * 300}]]),
    "map_past_64_keys": pack([1.0, [{f"k{i}": i for i in range(65)}]]),
    "ext_type": pack([1.0, [msgpack.ExtType(1, b"x")]]),
    "not_an_array": pack({"ts": 1.0}),
    "tokens_not_block_size_each": pack([1.0, [{**stored(2, 4), "token_ids": [1] * 7}]]),
}


def read_stepwise(payload: bytes) -> list[object]:
    reader = BatchReader(payload)
    return list(reader.events())


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_both_decoders_refuse_a_hostile_batch(name: str) -> None:
    payload = HOSTILE[name]
    assert len(payload) <= MAX_BATCH_BYTES, name  # the size bound alone does not catch it
    with pytest.raises(ValueError):
        decode_batch(payload)
    with pytest.raises(ValueError):
        read_stepwise(payload)


def test_an_event_at_the_token_bound_decodes_and_both_decoders_agree() -> None:
    at_bound = pack([1.0, [stored(MAX_EVENT_TOKENS // 4096, 4096)], 0])
    whole, stepwise = decode_batch(at_bound).events, read_stepwise(at_bound)
    assert whole == tuple(stepwise) and len(whole[0].token_ids) == MAX_EVENT_TOKENS  # type: ignore[union-attr]
    event = BlockStored((1, 2), None, [1, 2, 3, 4], 2)
    assert read_stepwise(encode_batch([event], ts=1.0)) == [event]


def test_an_oversized_event_is_refused_at_its_array_header() -> None:
    """The token bound is msgpack's own array-length check: the header is refused before
    any of its 4M ids is read (msgpack names the bound it ran into)."""
    payload = HOSTILE["event_tokens_past_bound"]
    for decode in (decode_batch, read_stepwise):
        with pytest.raises(ValueError, match="max_array_len"):
            decode(payload)
