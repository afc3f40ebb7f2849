"""KV-cache events in vLLM's schema: what workers publish and routers index.

vLLM (`vllm/distributed/kv_events.py`) and SGLang publish, per engine step, a batch

    [ts, [event, ...], data_parallel_rank]          (msgpack, array_like)

    BlockStored     block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, extra_keys (the last two: newer vLLM, 0.32 here)
    BlockRemoved    block_hashes, medium
    AllBlocksCleared

vLLM 0.32 writes each event as a map tagged `{"type": "BlockStored", ...}`; SGLang (and
newer vLLM) as an array led by the tag, `["BlockStored", hashes, parent, ...]`. `decode_batch`
reads both (msgspec's typed decoding first, msgpack and Python checks for what it cannot
prove), and `encode_batch` writes vLLM's map form, the one format in our Redis streams
(`radix-worker attach` re-encodes what it forwards; our engine writes it directly).

Everything decoded here may come from an untrusted peer (a stream any worker can write
to, a ZMQ socket): sizes are bounded and types checked, and anything else is a
`ValueError`, which callers drop and count. An engine's block hash is an opaque id (bytes
or a 64-bit int): the router keys blocks by content and parent (`block_key`), so it never
depends on how an engine hashes.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias

import numpy as np

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUMS = frozenset({MEDIUM_GPU, MEDIUM_CPU, "STORAGE"})

MAX_BATCH_BYTES = 4 * 1024 * 1024  # one stream entry / ZMQ frame
MAX_EVENTS = 4096  # events in one batch
MAX_BLOCKS = 8192  # hashes in one event
# Token ids in one event, and so the longest array msgpack decodes: one event is one
# decode call (BatchReader's step), and 4M ids in one event (inside MAX_BATCH_BYTES, in
# 4,096-token blocks) held the event loop ~140-200 ms to decode and check. 2**18 is two
# 128k-token contexts; vLLM stores a step's blocks per event (a chunked prefill's
# worth), our engine at most this many per event (worker/engine/kv_blocks.py).
MAX_EVENT_TOKENS = 1 << 18
MAX_BLOCK_SIZE = 4096  # tokens per block
MAX_TOKEN_ID = 2**31 - 1
MAX_HASH_BYTES = 64
MAX_EXTRA_KEYS = 8  # items in one block's extra_keys (strings bounded by max_str_len)

BlockHash: TypeAlias = bytes | int


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int] | np.ndarray  # len == len(block_hashes) * block_size
    # 0 (and no token ids, no parent): blocks the engine named before, now stored in
    # `medium` too (vLLM's offloading connector writes these for its CPU tier).
    block_size: int
    medium: str | None = MEDIUM_GPU
    # vLLM's `extra_keys`: per block, what its hash mixed in beside the tokens (a LoRA
    # name, a cache_salt on the first block, ...), or None; None for the whole event when
    # no block has any. Bounded: MAX_EXTRA_KEYS items of short strings or ints.
    extra_keys: tuple[tuple[str | int, ...] | None, ...] | None = None
    # The LoRA adapter the blocks were computed with: vLLM's `lora_name`, else its
    # `lora_id` (all an event has where the schema predates `lora_name`); None: the base.
    lora: str | int | None = None
    # `token_ids` as their key text (`ids_text`), where the decoder already packed them to
    # check them: the index keys blocks from it (`block_key_text`) with no conversion.
    # Derived from `token_ids`: not part of the event's value (equality, repr).
    token_text: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]


# ---- block identity -----------------------------------------------------------------


_MASK64 = (1 << 64) - 1
ID_CHARS = 4  # chars of an id's key text: its uint32 little-endian bytes, read as Latin-1


def ids_text(tokens: Sequence[int]) -> str | None:
    """The ids as key text: their uint32 little-endian bytes read as Latin-1 (one C call;
    shared/tokens/prompt_ids.py's TokenKey is the same text). None where one is not an
    int in [0, 2**32) (a client's token-id prompt can hold anything)."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens).decode("latin-1")
    except struct.error:
        return None


def block_key_text(text: str, block_size: int, parent: int = 0) -> list[int]:
    """`block_key_list` of ids given as their key text (`ids_text`): each whole block's
    key is the hash of (its parent's key, its ID_CHARS * block_size chars of the text).

    One slice and one hash a block, both in C: str's hash runs over the block's bytes
    in one pass, where a tuple of the block's ints built one item at a time cost about
    twice as much (0.18 against 0.30 µs a 16-token block). The str hash is keyed per
    process (SipHash, PYTHONHASHSEED): keys are compared only inside the router that
    made them (requests and events alike), and a peer cannot craft a collision."""
    width = ID_CHARS * block_size
    keys = []
    key = parent
    for start in range(0, len(text) - len(text) % width, width):
        key = hash((key, text[start : start + width])) & _MASK64
        keys.append(key)
    return keys


def block_key_list(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Each whole block's identity (a 64-bit int): its tokens and everything before it,
    chained from `parent` (0 at the root), so a block's key is its content and its
    parent's key:  K_i = hash((K_(i-1), block_i as key text)) (`block_key_text`).

    Not collision-proof, as no 64-bit key is; a collision costs a wrong prediction for
    one block, never a wrong answer. Ids that are no token ids (a client's prompt can
    hold anything) are keyed apart (a tuple of the ints, tagged): no worker stores
    them, so their keys need only match each other."""
    text = ids_text(tokens)
    if text is not None:
        return block_key_text(text, block_size, parent)
    keys = []
    key = parent
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        key = hash(("ids", key, *tokens[start : start + block_size])) & _MASK64
        keys.append(key)
    return keys


def block_keys(tokens: np.ndarray, block_size: int, parent: int = 0) -> np.ndarray:
    """`block_key_list` as a uint64 array (the events' token ids are int64 arrays).
    Both the index's events and the requests' lookups key blocks this way."""
    ids = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    return np.array(block_key_list(ids, block_size, parent), dtype=np.uint64)


def engine_block_hash(parent: BlockHash | None, tokens: bytes) -> int:
    """Our engine's published hash (blake2b, as engines hash: not the router's
    `block_key_list`), a 64-bit int as vLLM writes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
    p = b"" if parent is None else int(parent).to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(p + tokens, digest_size=8).digest(), "big")


# ---- encoding -----------------------------------------------------------------------


def _event_obj(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": np.asarray(event.token_ids, dtype=np.int64).tolist(),
            "block_size": event.block_size,
            "lora_id": event.lora if type(event.lora) is int else None,
            "medium": event.medium,
            "lora_name": event.lora if isinstance(event.lora, str) else None,
            "extra_keys": None if event.extra_keys is None else [
                None if k is None else list(k) for k in event.extra_keys
            ],
        }  # fmt: skip
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[KVEvent], ts: float | None = None) -> bytes:
    """vLLM's wire form of one batch (data_parallel_rank omitted, as vLLM omits defaults)."""
    import msgpack  # here, not at the top: the engine makes events without it (GPU machine)

    batch = [time.time() if ts is None else ts, [_event_obj(e) for e in events]]
    return msgpack.packb(batch, use_bin_type=True)


# ---- decoding (untrusted input) -------------------------------------------------------

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
    answer either way (tests/shared/wire/test_kv_events_typed.py compares them)."""
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
    import msgpack  # see encode_batch

    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_array_len=MAX_EVENT_TOKENS,
            max_map_len=64, max_str_len=256, max_bin_len=MAX_HASH_BYTES, max_ext_len=0,
        )  # fmt: skip
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise ValueError(f"batch is not msgpack: {str(exc)[:80]}") from None
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
    malformed batch whole collects the events before it applies any."""

    def __init__(self, payload: bytes) -> None:
        import msgpack  # see encode_batch

        if (
            not isinstance(payload, bytes | bytearray | memoryview)
            or len(payload) > MAX_BATCH_BYTES
        ):
            raise ValueError("batch is not bytes or is too large")
        self._size = len(payload)
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
        for _ in range(self.count):
            yield _decode_event(self._read(self._unpacker.unpack))
        if self._items == 3:
            self._read(self._unpacker.skip)  # data_parallel_rank
        if self._unpacker.tell() != self._size:
            raise ValueError("batch is not msgpack: extra data after it")


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


def _check_ids(tokens: list[object]) -> str:
    """Token ids, each an int in [0, MAX_TOKEN_ID], checked in C with no Python loop per
    token; returns them as key text (`ids_text`: the index keys blocks from it) and the
    list is kept as it is. Packed as little-endian int32 (`struct` refuses non-ints and
    anything outside [-2**31, 2**31 - 1]; about half of `array("i", ...)`'s time: ~2.4
    against ~4.9 µs for a turn's 288 ids), then the sign bytes say whether any is
    negative: with none, the int32 bytes are the uint32 ones."""
    try:
        packed = struct.pack(f"<{len(tokens)}i", *tokens)
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
    whose events are all in the array form; each event decodes to a Struct whose
    `event()` is its KVEvent, or raises ValueError where a rule no msgspec type states
    fails (the checked decoder then decides).

    Every type is closed (no unknown key, no item past the last field, every string,
    bytes and array bounded as msgpack's bounds in `_decode_checked` do), so a batch
    they accept is one the checked decoder accepts with the same events; the one
    difference is a map's duplicate keys (the last wins in both): msgpack counted each
    against its 64-entry bound, msgspec cannot, so a map of more than 64 entries of
    known keys, each value valid, passes here (its work bounded by the batch's size).
    Built on first use: msgspec is imported here, not at the top (the GPU machine's
    engine encodes events without it)."""
    from msgspec import UNSET, Meta, UnsetType, defstruct
    from msgspec.msgpack import Decoder

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

    def decoder(form: dict[str, Any]) -> Any:
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
        return Decoder(batch)

    return (
        decoder({"tag_field": "type", "forbid_unknown_fields": True}),
        decoder({"array_like": True}),
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


# ---- stream entries (Redis) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One entry of a worker's event stream: a batch stamped with the writer's epoch and
    a sequence number that starts at 0 in each epoch and grows by one per entry.

    `resync`: the writer lost events it cannot get back (a stock engine's replay could
    not serve a gap, worker/attach/kv_subscriber.py). It follows the hole it leaves in the
    sequence, so a reader that does not know the field still sees a gap; one that does
    rebuilds the worker's index from here (router/holdings/kv_feed.py)."""

    worker_id: str
    epoch: float
    seq: int
    batch: EventBatch
    resync: bool = False


def entry_fields(
    worker_id: str, epoch: float, seq: int, payload: bytes, resync: bool = False
) -> dict[str, bytes | str]:
    fields: dict[str, bytes | str] = {
        "worker": worker_id, "epoch": repr(float(epoch)), "seq": str(seq), "batch": payload,
    }  # fmt: skip
    if resync:
        fields["resync"] = "1"
    return fields


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """An entry's small fields, read before its batch is decoded: a reader drops an
    entry of an old epoch on these alone (decoding costs ~1 ms per MB)."""

    worker_id: str
    epoch: float
    seq: int
    payload: bytes
    resync: bool = False

    def decode(self) -> StreamEntry:
        """The whole entry; ValueError when its batch is malformed."""
        batch = decode_batch(self.payload)
        return StreamEntry(self.worker_id, self.epoch, self.seq, batch, self.resync)


def parse_entry(owner: str, fields: dict[bytes, bytes]) -> StreamEntry:
    """An entry read from `owner`'s stream; ValueError when malformed or not `owner`'s."""
    return parse_header(owner, fields).decode()


def parse_header(owner: str, fields: dict[bytes, bytes]) -> EntryHeader:
    """An entry's fields but its batch (not decoded); ValueError when malformed or not
    `owner`'s."""
    if not isinstance(fields, dict) or len(fields) > 8:
        raise ValueError("entry is not a small map")
    try:
        worker = fields[b"worker"].decode()
        epoch = float(fields[b"epoch"].decode())
        seq = int(fields[b"seq"].decode())
        payload = fields[b"batch"]
        resync = fields.get(b"resync", b"0")
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"entry lacks or garbles a field ({str(exc)[:40]})") from None
    if worker != owner:
        raise ValueError(f"entry names another worker ({worker[:40]!r})")
    if not (epoch == epoch and 0 <= epoch < 1e12) or not 0 <= seq < 2**63:
        raise ValueError("entry epoch or seq out of range")
    if resync not in (b"0", b"1"):
        raise ValueError("entry resync is neither 0 nor 1")
    if not isinstance(payload, bytes) or len(payload) > MAX_BATCH_BYTES:
        raise ValueError("batch is not bytes or is too large")
    return EntryHeader(worker, epoch, seq, payload, resync == b"1")
