"""The typed KV-event decoder (msgspec, shared/wire/kv_decode.py `_typed_decoders`) against
the checked one (msgpack and Python checks, `_decode_checked`: main's decoder, kept as the
fallback and the oracle here). `decode_batch` tries the typed one first; what it accepts
must be what the checked one accepts, with the same events, and everything else is the
checked one's to decide. So over random, mutated and hand-made batches in both forms:
the typed decoder alone accepts only what the checked one accepts, with the same events
(token_text included), and `decode_batch` answers as the checked one does, or both
refuse with ValueError. `BatchReader` (a large batch an event at a time: each event's
bytes found by msgpack's skip, then typed or checked, `_decode_item`) answers the same
too: before, it unpacked each event and checked it in Python, as the checked decoder
does."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.wire.kv_decode import _decode_checked, _typed_decoders
from shared.wire.kv_events import (
    MAX_BLOCK_SIZE,
    MAX_TOKEN_ID,
    AllBlocksCleared,
    BatchReader,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                "medium", "lora_name", "extra_keys")  # fmt: skip
REMOVED_ORDER = ("block_hashes", "medium")


def outcome(decode: object, payload: bytes) -> str:
    """What a decoder answers, as text that tells types apart (1 from True, a list from
    a tuple); a refusal is a ValueError, any other exception fails the test."""
    try:
        batch: EventBatch = decode(payload)  # type: ignore[operator]
    except ValueError:
        return "refused"
    ts = "nan" if math.isnan(batch.ts) else repr(batch.ts)
    return ts + repr([(e, getattr(e, "token_text", None)) for e in batch.events])


def typed_outcome(payload: bytes) -> str | None:
    """The typed decoder alone (either form): its answer, or None where it declines."""
    for decoder in _typed_decoders():
        try:
            typed = decoder.decode(payload)
            batch = EventBatch(typed.ts, tuple(e.event() for e in typed.events))
        except ValueError:
            continue
        return outcome(lambda _: batch, b"")  # noqa: B023 (returned at once)
    return None


def stepwise(payload: bytes) -> EventBatch:
    """`BatchReader`'s answer: its events read to the end, as one batch."""
    reader = BatchReader(payload)
    return EventBatch(reader.ts, tuple(reader.events()))


def check_agrees(payload: bytes) -> str:
    checked = outcome(_decode_checked, payload)
    typed = typed_outcome(payload)
    if typed is not None:
        assert typed == checked, "the typed decoder accepted what the checked one answers otherwise"
    assert outcome(decode_batch, payload) == checked
    assert outcome(stepwise, payload) == checked, "BatchReader answers otherwise"
    return checked


# ---- payloads by hand: a map event with duplicate keys, the array form past its fields ----


def pack_pairs(pairs: list[tuple[object, object]]) -> bytes:
    """A msgpack map of `pairs` in order, duplicates kept (a dict cannot hold them)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in pairs)


def pack_batch(events: list[bytes], ts: object = 1.0, rest: tuple = ()) -> bytes:
    """[ts, [events...], *rest] around events already packed."""
    items = 2 + len(rest)
    n = len(events)
    head = b"\xdc" + n.to_bytes(2, "big")
    return (bytes([0x90 | items]) + msgpack.packb(ts) + head + b"".join(events)
            + b"".join(msgpack.packb(r, use_bin_type=True) for r in rest))  # fmt: skip


def stored_pairs(n: int = 2, bs: int = 4, **over: object) -> list[tuple[object, object]]:
    f = {"type": "BlockStored", "block_hashes": list(range(100, 100 + n)),
         "parent_block_hash": None, "token_ids": list(range(1, n * bs + 1)), "block_size": bs,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}  # fmt: skip
    f.update(over)
    return list(f.items())


def test_our_streams_form_is_the_typed_decoders_and_answers_as_before() -> None:
    """encode_batch's map form (our streams) and the array form both pass typed."""
    events = [
        BlockStored((1, 2), None, list(range(8)), 4),
        BlockStored((3,), 2, [5, 6, 7, MAX_TOKEN_ID], 4, "CPU", (("salt", 7),), "adapter"),
        BlockStored((b"\x01" * 64,), b"\x02", [0] * 16, 16, None, None, 3),
        BlockStored((4, 5), None, [], 0, "CPU"),  # an offload announcement
        BlockRemoved((2**64 - 1, -(2**63)), None),
        AllBlocksCleared(),
    ]
    payload = encode_batch(events, ts=5.0)
    assert typed_outcome(payload) is not None and check_agrees(payload) != "refused"
    decoded = decode_batch(payload).events
    assert decoded[:3] + decoded[4:] == tuple(events[:3] + events[4:])  # (3: ids as an array)
    array_form = [
        ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"],
        ["BlockRemoved", [1]],
        ["AllBlocksCleared"],
    ]
    payload = msgpack.packb([2, array_form, 0])
    assert typed_outcome(payload) is not None and check_agrees(payload) != "refused"


@pytest.mark.parametrize(
    "pairs",
    [
        # duplicates: the last one wins, in both decoders
        [*stored_pairs(), ("block_size", 2), ("block_hashes", [7, 8, 9, 10])],
        [*stored_pairs(), ("medium", "CPU"), ("medium", None)],
        [*stored_pairs(), ("type", "BlockRemoved")],
        [*stored_pairs(), ("type", "BlockStored")],
        # unknown keys: the typed decoder declines, the checked one accepts as before
        [*stored_pairs(), ("group_idx", 3)],
        [*stored_pairs(), (b"bytes_key", 1)],
        [*stored_pairs(), ("unknown", "x" * 300)],  # past msgpack's string bound: refused
        # a float where an int goes, a bool as an int: refused
        stored_pairs(block_size=4.0),
        stored_pairs(block_size=True),
        stored_pairs(block_hashes=[1.0, 2]),
        stored_pairs(block_hashes=[True, 2]),
        stored_pairs(token_ids=[1, 2, 3, 4, 5, 6, 7, 8.0]),
        stored_pairs(token_ids=[True, 2, 3, 4, 5, 6, 7, 8]),
        stored_pairs(lora_id=2.0),
        # the checked decoder's leniencies, kept: lora_id False or 0.0 is "no adapter",
        # an offload announcement's LoRA and extra keys go unread
        stored_pairs(lora_id=False),
        stored_pairs(lora_id=0.0),
        stored_pairs(block_size=0, token_ids=[], lora_name=5, extra_keys="x"),
        stored_pairs(lora_name="x" * 65),  # over the typed 64 chars, within 256 bytes
        stored_pairs(lora_name="é" * 129),  # 258 bytes: refused
        stored_pairs(extra_keys=[["a" * 200, 1], None]),
        stored_pairs(medium=["GPU"]),  # was a TypeError (unhashable), now refused
        stored_pairs(medium={"a": 1}),
        stored_pairs(block_size=MAX_BLOCK_SIZE + 1),
    ],
)
def test_hand_made_maps_answer_as_the_checked_decoder(pairs: list[tuple[object, object]]) -> None:
    check_agrees(pack_batch([pack_pairs(pairs)]))


def test_a_medium_that_is_not_a_string_is_refused_not_a_type_error() -> None:
    """The checked decoder looked an unhashable medium up in a set: a TypeError, which the
    feed (router/holdings/feed_entries.py catches ValueError) did not drop."""
    for medium in (["GPU"], {"a": 1}):
        for event in ({"type": "BlockRemoved", "block_hashes": [1], "medium": medium},
                      dict(stored_pairs(medium=medium))):  # fmt: skip
            with pytest.raises(ValueError, match="unknown medium"):
                decode_batch(msgpack.packb([1.0, [event]]))


def test_more_than_64_duplicate_keys_pass_typed_the_one_difference() -> None:
    """msgpack counted a map's entries against its 64-entry bound, duplicates too; msgspec
    reads each (the last wins) with no such count. The typed decoder's docstring says so:
    the work stays bounded by the batch's size and each value's own bounds."""
    pairs = stored_pairs() + [("medium", "CPU")] * 70
    payload = pack_batch([pack_pairs(pairs)])
    assert outcome(_decode_checked, payload) == "refused"
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored) and event.medium == "CPU"
    assert stepwise(payload).events == (event,)  # an event at a time: the same difference


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, "trailing"],
        ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, "x" * 300],
        ["BlockStored", [1], None, [1, 2], 2],
        ["BlockStored", [1], None, [1, 2]],
        ["BlockRemoved", [1], "GPU", 5],
        ["AllBlocksCleared", {"deep": [[[]]]}],
        ["BlockStored"],
        [],
    ],
)
def test_array_events_past_or_short_of_their_fields(event: list[object]) -> None:
    check_agrees(msgpack.packb([1.0, [event]]))


@pytest.mark.parametrize(
    "rest", [(), (0,), (None,), ("rank",), ("x" * 300,), (0, 0), (1.5,)], ids=repr
)
def test_a_batchs_data_parallel_rank_and_items_past_it(rest: tuple) -> None:
    check_agrees(pack_batch([pack_pairs(stored_pairs())], 1.0, rest))


def test_mixed_forms_in_one_batch_are_the_checked_decoders() -> None:
    payload = msgpack.packb([1.0, [dict(stored_pairs()), ["BlockRemoved", [100]]]])
    assert typed_outcome(payload) is None
    assert check_agrees(payload) != "refused"


def test_the_module_imports_and_encodes_without_msgspec() -> None:
    """The GPU machine's engine encodes events with no msgspec installed: it is imported
    where a batch is decoded, not with the module."""
    code = textwrap.dedent("""
        import sys
        sys.modules["msgspec"] = None  # unimportable
        from shared.wire.kv_events import AllBlocksCleared, encode_batch
        from shared.wire.kv_decode import _decode_checked
        assert _decode_checked(encode_batch([AllBlocksCleared()])).events == (AllBlocksCleared(),)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- random and mutated batches ------------------------------------------------------

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(-1, 3), max_size=3),
)  # fmt: skip
a_hash = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=0, max_size=66), anything)
a_token = st.one_of(
    st.integers(0, MAX_TOKEN_ID),
    st.sampled_from([0, MAX_TOKEN_ID, MAX_TOKEN_ID + 1, 2**32, -1]),
    anything,
)
a_string = st.one_of(st.text(max_size=3), st.text(min_size=60, max_size=70),
                     st.text(alphabet="é€𝄞", min_size=60, max_size=130))  # fmt: skip


def mostly(draw: st.DrawFn, good: st.SearchStrategy, bad: st.SearchStrategy) -> object:
    """A good value five times in six, else a bad one: most batches then reach the
    checks past the first field."""
    return draw(bad if draw(st.integers(0, 5)) == 0 else good)


@st.composite
def a_stored(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([0, 1, 2, 4, 4, 16, MAX_BLOCK_SIZE + 1, -1]))
    offload = bs == 0 and draw(st.booleans())
    good_tokens = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=n * bs, max_size=n * bs) \
        if 0 <= bs < 64 else st.just([])  # fmt: skip
    keys = st.lists(st.one_of(a_string, st.integers(-(2**63), 2**64 - 1), anything), max_size=9)
    return {
        "block_hashes": mostly(draw, st.lists(st.integers(-(2**63), 2**64 - 1), min_size=n,
                               max_size=n), st.one_of(st.lists(a_hash, max_size=n), anything)),
        "parent_block_hash": None if offload else mostly(draw, st.none(), a_hash),
        "token_ids": [] if offload else mostly(draw, good_tokens,
                                               st.one_of(st.lists(a_token, max_size=9), anything)),
        "block_size": mostly(draw, st.just(bs), anything),
        "lora_id": mostly(draw, st.one_of(st.none(), st.integers(0, 9)),
                          st.one_of(st.integers(-1, 2**63), anything)),
        "medium": mostly(draw, st.sampled_from(["GPU", "CPU", "STORAGE", None]),
                         st.one_of(st.just("gpu"), anything)),
        "lora_name": mostly(draw, st.one_of(st.none(), st.text(min_size=1, max_size=9)),
                            st.one_of(a_string, anything)),
        "extra_keys": mostly(draw, st.one_of(st.none(), st.lists(
            st.one_of(st.none(), keys), min_size=n, max_size=n)), st.one_of(st.lists(
            st.one_of(st.none(), keys), min_size=max(n - 1, 0), max_size=n + 1), anything)),
    }  # fmt: skip


@st.composite
def an_event(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if kind == "BlockStored":
        fields, order = draw(a_stored()), STORED_ORDER
    elif kind == "BlockRemoved":
        fields = {
            "block_hashes": draw(st.one_of(st.lists(a_hash, max_size=4), anything)),
            "medium": draw(st.one_of(st.sampled_from(["GPU", "CPU", None]), anything)),
        }
        order = REMOVED_ORDER
    else:
        fields, order = {}, ()
    if draw(st.booleans()):  # the array form, maybe short of or past its fields
        items = [kind, *(fields[k] for k in order)]
        cut = draw(st.integers(1, len(items) + 2))
        items = items[:cut] + [draw(anything) for _ in range(cut - len(items))]
        return msgpack.packb(items, use_bin_type=True)
    pairs: list[tuple[object, object]] = [("type", kind)]
    for k in order:
        if draw(st.integers(0, 9)):  # a key left out now and then
            pairs.append((k, fields[k]))
    if draw(st.integers(0, 4)) == 0:
        pairs.append(
            (draw(st.sampled_from(["block_size", "medium", "type", "other"])), draw(anything))
        )
    pairs = draw(st.permutations(pairs))
    return pack_pairs(pairs)


@st.composite
def a_batch(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(an_event(), max_size=4))
    ts = draw(st.one_of(st.floats(), st.integers(-(2**63), 2**64 - 1), anything))
    rest = draw(st.sampled_from([(), (0,), (None,), (3, 4)]))
    return pack_batch(events, ts, rest)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a_batch())
def test_random_batches_answer_as_the_checked_decoder(payload: bytes) -> None:
    check_agrees(payload)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_batches_answer_as_the_checked_decoder(data: st.DataObject) -> None:
    """A valid batch of our form with a byte changed, cut, inserted or repeated."""
    events = [BlockStored((1, 2), None, list(range(300, 308)), 4, "GPU", None, "a"),
              BlockRemoved((7,)), AllBlocksCleared()]  # fmt: skip
    payload = bytearray(encode_batch(events, ts=1.0))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(payload) - 1))
        how = data.draw(st.sampled_from(["set", "cut", "insert", "repeat"]))
        if how == "set":
            payload[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del payload[at:]
            if not payload:
                payload += b"\x90"
        elif how == "insert":
            payload[at:at] = bytes([data.draw(st.integers(0, 255))])
        else:
            payload += payload[at:]
    check_agrees(bytes(payload))
