"""Decoding a KV-event batch (shared/wire/kv_schema.py) from an untrusted peer: a stream any
worker can write to, a ZMQ socket. Sizes are bounded and types checked, and anything else
is a `ValueError`, which callers drop and count.

vLLM 0.32 writes each event as a map tagged `{"type": "BlockStored", ...}`; SGLang (and
newer vLLM) as an array led by the tag, `["BlockStored", hashes, parent, ...]`.
`decode_batch` reads both: msgspec's typed decoding first (`_typed_decoders`), msgpack and
Python checks (`_decode_checked`) for what it cannot prove. `BatchReader` decodes a large
batch an event at a time, each event as `decode_batch` would (`_decode_item`).
shared/wire/kv_events.py names these too (its importers' module).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import numpy as np

from shared.wire.kv_schema import (
    MAX_BATCH_BYTES,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_EVENT_TOKENS,
    MAX_EVENTS,
    MAX_EXTRA_KEYS,
    MAX_HASH_BYTES,
    MEDIUMS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

_STORED_ORDER = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_ORDER = ("block_hashes", "medium")


def decode_batch(payload: bytes) -> EventBatch:
    """One batch in vLLM's or SGLang's wire form; ValueError on anything else.

    Two decoders, one outcome: the typed one (`_typed_decoders`, msgspec: bounds and
    types checked in C) takes the batches it can prove well formed, and anything it
    cannot is the checked one's to accept or refuse (`_decode_checked`, msgpack and
    Python checks), so what is accepted, refused and returned is the checked decoder's
    answer either way, but for one case `_typed_decoders` names (duplicate map keys;
    tests/shared/wire/test_kv_events_typed.py compares the two)."""
    if not isinstance(payload, bytes | bytearray | memoryview) or len(payload) > MAX_BATCH_BYTES:
        raise ValueError("batch is not bytes or is too large")
    for decoder in _typed_decoders():  # the map form (vLLM 0.32, our streams), the array form
        try:
            batch = decoder.decode(payload)
            return EventBatch(batch.ts, tuple([e.event() for e in batch.events]))
        except ValueError:  # msgspec's DecodeError and ValidationError, `_typed_stored`'s
            pass
    return _decode_checked(payload)


def _decode_checked(payload: bytes) -> EventBatch:
    """`decode_batch` by msgpack and a check of every field in Python."""
    raw = _unpack_bounded(payload)
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise ValueError("batch is not [ts, events(, dp_rank)]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise ValueError("batch ts is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise ValueError("batch events is not a list of bounded length")
    return EventBatch(float(ts), tuple([_decode_event(e) for e in events]))


class BatchReader:
    """`decode_batch` an event at a time, for a reader that lets other work run between
    the events of a large batch: 4 MB of msgpack decode in one call in ~70 ms (3 MB of
    20 stored events, measured), which no thread can take off an event loop (msgpack
    holds the GIL throughout); one event of them in ~4 ms. The checks and errors are
    decode_batch's, raised by the step that meets them: a caller that must drop a
    malformed batch whole collects the events before it applies any.

    An event's bytes are found by msgpack's `skip` (C, no object built: ~1.5 ns a byte,
    so a step is bounded by the batch's size, ~6 ms for one 4 MB event on a busy
    machine, where unpacking its ids was ~70 ms) and decoded as `decode_batch` decodes
    one (`_decode_item`): typed where msgspec proves it well formed, checked otherwise.
    On a real BPE tokenizer's stream (batches of ~110 KB, ~7,400 ids a routed request)
    that is 0.88x the time of unpacking and checking each event in Python (280 against
    319 us a request; the skip is ~33 of them, the ids' key text ~80)."""

    def __init__(self, payload: bytes) -> None:
        import msgpack  # see _unpack_bounded

        if (
            not isinstance(payload, bytes | bytearray | memoryview)
            or len(payload) > MAX_BATCH_BYTES
        ):
            raise ValueError("batch is not bytes or is too large")
        self._size = len(payload)
        self._payload = memoryview(payload)
        self._unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=MAX_BATCH_BYTES, max_array_len=MAX_EVENT_TOKENS,
            max_map_len=64, max_str_len=256, max_bin_len=MAX_HASH_BYTES, max_ext_len=0,
        )  # fmt: skip
        self._unpacker.feed(payload)
        self._items = self._read(self._unpacker.read_array_header)
        if self._items not in (2, 3):
            raise ValueError("batch is not [ts, events(, dp_rank)]")
        ts = self._read(self._unpacker.unpack)
        if not isinstance(ts, int | float) or isinstance(ts, bool):
            raise ValueError("batch ts is not a number")
        self.ts = float(ts)
        self.count = self._read(self._unpacker.read_array_header)
        if self.count > MAX_EVENTS:
            raise ValueError("batch events is not a list of bounded length")

    @staticmethod
    def _read(step: Any) -> Any:
        import msgpack

        try:
            return step()
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            raise ValueError(f"batch is not msgpack: {str(exc)[:80]}") from None

    def events(self) -> Iterator[KVEvent]:
        """The batch's events, decoded one per item; then the batch must end."""
        import msgpack  # (once: `_read`'s import a step was ~5% of the step)

        unpacker, payload = self._unpacker, self._payload
        refused = (ValueError, msgpack.UnpackException, TypeError)  # as in `_read`
        for _ in range(self.count):
            start = unpacker.tell()
            try:
                unpacker.skip()
            except refused as exc:
                raise ValueError(f"batch is not msgpack: {str(exc)[:80]}") from None
            yield _decode_item(payload[start : unpacker.tell()])
        if self._items == 3:
            # data_parallel_rank: unpacked, not skipped, so msgpack's bounds refuse what
            # they refuse in decode_batch (a skip checks none: a 300-char rank passed)
            self._read(unpacker.unpack)
        if self._unpacker.tell() != self._size:
            raise ValueError("batch is not msgpack: extra data after it")


def _unpack_bounded(payload: bytes | memoryview) -> object:
    """msgpack's decode of `payload` within the wire's bounds; ValueError otherwise."""
    import msgpack  # here, not at the top: the engine makes events without it (GPU machine)

    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_array_len=MAX_EVENT_TOKENS,
            max_map_len=64, max_str_len=256, max_bin_len=MAX_HASH_BYTES, max_ext_len=0,
        )  # fmt: skip
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise ValueError(f"batch is not msgpack: {str(exc)[:80]}") from None


def _decode_item(item: bytes | memoryview) -> KVEvent:
    """One event's msgpack bytes (an item of a batch's events), as `decode_batch` decodes
    it: the typed decoders first (either form), the checked decoder for the rest."""
    for decoder in _typed_event_decoders():
        try:
            return decoder.decode(item).event()
        except ValueError:
            pass
    return _decode_event(_unpack_bounded(item))


def _fields(raw: object, order: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        kind = raw.get("type")
        return kind, raw  # type: ignore[return-value]
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(order, raw[1:], strict=False))
    raise ValueError("event is neither a tagged map nor a tagged array")


def _decode_event(raw: object) -> KVEvent:
    tag = (
        raw.get("type")
        if isinstance(raw, dict)
        else (raw[0] if isinstance(raw, list) and raw else None)
    )
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_ORDER)
        hashes = _hashes(f.get("block_hashes"))
        size = f.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_BLOCK_SIZE:
            raise ValueError("block_size out of range")
        tokens = f.get("token_ids")
        if size == 0 and tokens == [] and f.get("parent_block_hash") is None:
            # A store known by hash only: vLLM's offloading connector announces a block
            # it copied to its CPU tier so unless its events are "self-describing".
            return BlockStored(hashes, None, np.empty(0, np.int64), 0, _medium(f))
        if size == 0 or not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
            raise ValueError("token_ids is not block_size tokens per block")
        text = _check_ids(tokens)
        parent = f.get("parent_block_hash")
        return BlockStored(
            hashes, None if parent is None else _hash(parent), tokens, size, _medium(f),
            _extra_keys(f.get("extra_keys"), len(hashes)), _lora(f), text,
        )  # fmt: skip
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_ORDER)
        return BlockRemoved(_hashes(f.get("block_hashes")), _medium(f))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {str(tag)[:40]!r}")


# Each count of ids' packer, made once: `struct.pack(f"<{n}i", ...)` builds and looks up
# its format every call, ~45% of packing a 2-block event's 32 ids (the live sim stream's
# common event). A stream's events come in few counts (whole blocks); past _PACKERS_MAX
# counts the cache starts again, so odd counts cost a Struct each (~1 us), no memory.
_PACKERS: dict[int, Callable[..., bytes]] = {}
_PACKERS_MAX = 256


def _packer(count: int) -> Callable[..., bytes]:
    if len(_PACKERS) >= _PACKERS_MAX:
        _PACKERS.clear()
    pack = _PACKERS[count] = struct.Struct(f"<{count}i").pack
    return pack


def _check_ids(tokens: list[object]) -> str:
    """Token ids, each an int in [0, MAX_TOKEN_ID], checked in C with no Python loop per
    token; returns them as key text (`ids_text`: the index keys blocks from it) and the
    list is kept as it is. Packed as little-endian int32 (`struct` refuses non-ints and
    anything outside [-2**31, 2**31 - 1]; about half of `array("i", ...)`'s time: ~2.4
    against ~4.9 µs for a turn's 288 ids), then the sign bytes say whether any is
    negative: with none, the int32 bytes are the uint32 ones."""
    pack = _PACKERS.get(len(tokens))
    if pack is None:
        pack = _packer(len(tokens))
    try:
        packed = pack(*tokens)
    except struct.error:
        raise ValueError("token ids are not integers in range") from None
    if not packed[3::4].isascii():  # a sign bit set: a negative id
        raise ValueError("token id out of range")
    return packed.decode("latin-1")


def _hash(value: object) -> BlockHash:
    if type(value) is int and -(2**63) <= value < 2**64:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise ValueError("block hash is neither a 64-bit int nor short bytes")


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS:
        raise ValueError("block_hashes is not a non-empty list of bounded length")
    if set(map(type, value)) == {int} and min(value) >= -(2**63) and max(value) < 2**64:
        return tuple(value)  # the common case (64-bit int hashes), checked in C
    return tuple(_hash(v) for v in value)


def _extra_keys(value: object, blocks: int) -> tuple[tuple[str | int, ...] | None, ...] | None:
    """vLLM's per-block extra keys: None, or one entry (None or a short list of strings and
    ints) per block."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != blocks:
        raise ValueError("extra_keys is not one entry per block")
    out: list[tuple[str | int, ...] | None] = []
    for keys in value:
        if keys is None:
            out.append(None)
            continue
        if not isinstance(keys, list) or len(keys) > MAX_EXTRA_KEYS:
            raise ValueError("an extra_keys entry is not a short list")
        for k in keys:
            if not (isinstance(k, str) or (type(k) is int and -(2**63) <= k < 2**64)):
                raise ValueError("an extra key is neither a string nor a 64-bit int")
        out.append(tuple(keys))
    return tuple(out)


def _lora(f: dict[str, Any]) -> str | int | None:
    """`lora_name` where set, else `lora_id` (an int; 0 is vLLM's "no adapter")."""
    name, lid = f.get("lora_name"), f.get("lora_id")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name is not a non-empty string")
        return name
    if lid is None or lid == 0:
        return None
    if type(lid) is not int or not 0 < lid < 2**63:
        raise ValueError("lora_id is not a positive int")
    return lid


def _medium(f: dict[str, Any]) -> str | None:
    medium = f.get("medium")
    if medium is None:
        return None
    if not isinstance(medium, str) or medium not in MEDIUMS:  # (a list is unhashable)
        raise ValueError(f"unknown medium {str(medium)[:20]!r}")
    return medium


# ---- the typed decoder (msgspec) ------------------------------------------------------

# A string's chars in the typed decoder: msgpack bounded a string's bytes (max_str_len
# 256 above), and 64 chars are at most 256 bytes of UTF-8: a longer one is the checked
# decoder's to accept or refuse.
_TYPED_STR_CHARS = 64


@functools.cache
def _typed_decoders() -> tuple[Any, Any]:
    """msgspec decoders of a batch whose events are all in vLLM's map form, and of one
    whose events are all in the array form (`_typed_types`)."""
    from msgspec.msgpack import Decoder

    return tuple(Decoder(batch) for batch, _ in _typed_types())  # type: ignore[return-value]


@functools.cache
def _typed_event_decoders() -> tuple[Any, Any]:
    """msgspec decoders of one event in the map form, and of one in the array form."""
    from msgspec.msgpack import Decoder

    return tuple(Decoder(event) for _, event in _typed_types())  # type: ignore[return-value]


@functools.cache
def _typed_types() -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """The typed decoders' types: (batch, event) for the map form, then for the array
    form. Each event decodes to a Struct whose `event()` is its KVEvent, or raises
    ValueError where a rule no msgspec type states fails (the checked decoder then
    decides).

    Every type is closed (no unknown key, no item past the last field, every string,
    bytes and array bounded as msgpack's bounds in `_decode_checked` do), so a batch
    they accept is one the checked decoder accepts with the same events; the one
    difference is a map's duplicate keys (the last wins in both): msgpack counted each
    against its 64-entry bound, msgspec cannot, so a map of more than 64 entries of
    known keys, each value valid, passes here (its work bounded by the batch's size).
    Built on first use: msgspec is imported here, not at the top (the GPU machine's
    engine encodes events without it)."""
    from msgspec import UNSET, Meta, UnsetType, defstruct

    hash_t = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
    hashes_t = Annotated[tuple[hash_t, ...], Meta(min_length=1, max_length=MAX_BLOCKS)]
    medium_t = Literal["GPU", "CPU", "STORAGE"] | None
    short_t = Annotated[str, Meta(max_length=_TYPED_STR_CHARS)]
    keys_t = Annotated[tuple[short_t | int, ...], Meta(max_length=MAX_EXTRA_KEYS)] | None
    fields = {
        "BlockStored": [
            ("block_hashes", hashes_t),
            ("parent_block_hash", hash_t | None),
            # ints: their range is `_check_ids`'s (msgspec's own ge/le cost ~17 ns an id)
            ("token_ids", Annotated[list[int], Meta(max_length=MAX_EVENT_TOKENS)]),
            ("block_size", Annotated[int, Meta(ge=0, le=MAX_BLOCK_SIZE)]),
            ("lora_id", Annotated[int, Meta(ge=0, le=2**63 - 1)] | None, None),
            ("medium", medium_t, None),
            ("lora_name", Annotated[str, Meta(min_length=1, max_length=_TYPED_STR_CHARS)] | None,
             None),
            ("extra_keys", Annotated[tuple[keys_t, ...], Meta(max_length=MAX_BLOCKS)] | None, None),
        ],
        "BlockRemoved": [("block_hashes", hashes_t), ("medium", medium_t, None)],
        "AllBlocksCleared": [],
    }  # fmt: skip
    methods = {
        "BlockStored": _typed_stored,
        "BlockRemoved": lambda self: BlockRemoved(self.block_hashes, self.medium),
        "AllBlocksCleared": lambda self: AllBlocksCleared(),
    }
    # an item past the last field (array form): the checked decoder's to refuse
    end = [("end", UnsetType, UNSET)]

    def types(form: dict[str, Any]) -> tuple[Any, Any]:
        # gc=False: the Structs hold ints, strings, bytes, lists and tuples of them: no cycle
        stored, removed, cleared = (
            defstruct(tag, fields[tag] + (end if form.get("array_like") else []),
                      namespace={"event": methods[tag]}, tag=tag, gc=False, **form)
            for tag in fields
        )  # fmt: skip
        batch = defstruct("Batch", [
            ("ts", float),
            ("events", Annotated[list[stored | removed | cleared], Meta(max_length=MAX_EVENTS)]),
            ("data_parallel_rank", int | None, None),
            *end,
        ], array_like=True, gc=False)  # fmt: skip
        return batch, stored | removed | cleared

    return (
        types({"tag_field": "type", "forbid_unknown_fields": True}),
        types({"array_like": True}),
    )


def _typed_stored(self: Any) -> BlockStored:
    """A typed BlockStored's event: the rules its types cannot state, as `_decode_event`."""
    hashes, size, tokens = self.block_hashes, self.block_size, self.token_ids
    if size == 0 and not tokens and self.parent_block_hash is None:
        # an offload announcement (see `_decode_event`): no tokens, no LoRA
        return BlockStored(hashes, None, np.empty(0, np.int64), 0, self.medium)
    if size == 0 or len(tokens) != len(hashes) * size:
        raise ValueError("token_ids is not block_size tokens per block")
    keys = self.extra_keys
    if keys is not None and len(keys) != len(hashes):
        raise ValueError("extra_keys is not one entry per block")
    lora = (self.lora_id or None) if self.lora_name is None else self.lora_name
    text = _check_ids(tokens)
    return BlockStored(hashes, self.parent_block_hash, tokens, size, self.medium, keys, lora, text)
