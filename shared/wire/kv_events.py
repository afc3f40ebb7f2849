"""KV-cache events in vLLM's schema: what workers publish and routers index.

The events, their batch and the wire's bounds are shared/wire/kv_schema.py's; decoding a
batch from an untrusted peer is shared/wire/kv_decode.py's; this module names both (the
one module the engine, the feed and the tests import) and owns the rest: a block's
identity in the router (`block_key_list`: by content and parent, whatever the engine's
hash), the wire form written (`encode_batch`: vLLM's map form, the one format in our
Redis streams; `radix-worker attach` re-encodes what it forwards, our engine writes it
directly), and the stream entries (Redis) that carry batches.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.wire.kv_decode import BatchReader, decode_batch
from shared.wire.kv_schema import (
    MAX_BATCH_BYTES,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_EVENT_TOKENS,
    MAX_EVENTS,
    MAX_EXTRA_KEYS,
    MAX_HASH_BYTES,
    MAX_TOKEN_ID,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUMS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

__all__ = [
    "ID_CHARS",
    "MAX_BATCH_BYTES",
    "MAX_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_EVENTS",
    "MAX_EVENT_TOKENS",
    "MAX_EXTRA_KEYS",
    "MAX_HASH_BYTES",
    "MAX_TOKEN_ID",
    "MEDIUMS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BatchReader",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EntryHeader",
    "EventBatch",
    "KVEvent",
    "StreamEntry",
    "block_key_list",
    "block_key_text",
    "block_keys",
    "decode_batch",
    "encode_batch",
    "engine_block_hash",
    "entry_fields",
    "ids_text",
    "parse_entry",
    "parse_header",
]  # fmt: skip

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


# ---- stream entries (Redis) ----------------------------------------------------------


@dataclass(slots=True)  # (not frozen, as the events: shared/wire/kv_schema.py says why)
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


@dataclass(slots=True)  # (not frozen: as StreamEntry)
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
