"""A replica's flush as one stream entry: its decisions and session entries framed as
records and compressed once (the wire and its bounds: router/holdings/sync_wire.py's
docstring).

    value  = replica id SEP zlib(record ...)          the stream field `b`
    record = KIND + body length (uint32 LE) + body    body = worker id SEP payload

Writing: `next_entry` turns a replica's buffer (router/holdings/sync.py) into entries,
each closed at `MAX_RECORDS` records or before `max_batch_bytes`. Reading: `SyncBatchReader.read`, which bounds and frames the whole entry
before decoding any record, so a bad entry is refused before anything of it is applied.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from router.holdings.sync_wire import (
    OTHER_TOKENIZER,
    SEP,
    SESSION_MAX_BYTES,
    Key,
    SessionEntry,
    encode_session,
    ids_of,
    packed_ids,
    session_of,
    worker_of,
)
from shared.tokens.fingerprint import FINGERPRINT_LEN
from shared.tokens.prompt_ids import TokenKey

FIELD = b"b"  # a batch's stream field (`d` and `s`: the versions before, one item each)
TEXT, TOKENS, SESSION = b"d", b"t", b"s"  # a record's KIND
# Records in one entry: a flush of a replica at ~10,000 decisions/s (20 ms) is one entry.
# A reader applies READ_ENTRIES entries a read on the event loop (router/holdings/sync.py):
# at most 16 x 256 decisions, where a page of the version before batches held 1,000.
MAX_RECORDS = 256
# An entry's records, inflated, unless one decision at `sync_max_chars` needs more.
BATCH_BYTES = 2**20
_HEAD = struct.Struct("<cI")  # KIND, body length
# Worker ids a reader keeps checked (a fleet has a few; past this the memo starts over).
_MEMO_MAX = 1024


def max_batch_bytes(max_chars: int) -> int:
    """An entry's records, inflated: BATCH_BYTES, or the bound one entry had before
    batches where that is more (4 bytes a char or an id, and room for the ids), so a
    decision at `sync_max_chars` always fits."""
    return max(BATCH_BYTES, 4 * max_chars + 1024)


def text_record(worker_id: str, text: str, max_chars: int) -> bytes:
    body = worker_id.encode() + SEP + text[:max_chars].encode("utf-8", "replace")
    return _HEAD.pack(TEXT, len(body)) + body


def token_record(
    worker_id: str, ids: TokenKey | Sequence[int] | np.ndarray, fingerprint: str, max_ids: int
) -> bytes | None:
    """None where the ids are not token ids (`packed_ids`): not shared."""
    packed = packed_ids(ids, max_ids)
    if packed is None:
        return None
    body = worker_id.encode() + SEP + fingerprint.encode() + b":" + packed
    return _HEAD.pack(TOKENS, len(body)) + body


def session_record(worker_id: str, digest: bytes, pin_ttl: float, placed: bool) -> bytes:
    body = encode_session(b"", worker_id, digest, pin_ttl, placed)
    return _HEAD.pack(SESSION, len(body)) + body


def pack(header: bytes, records: Sequence[bytes]) -> bytes:
    """One entry's value: `header` (replica id SEP) and the records, one zlib stream."""
    return header + zlib.compress(b"".join(records), 1)


# A buffered item: (worker id, text or TokenKey) a decision, bytes a record made already.
Item = tuple[str, str] | bytes


def next_entry(
    items: Sequence[Item], start: int, header: bytes, fingerprint: str | None, max_chars: int
) -> tuple[bytes | None, int, int]:
    """(the next entry's value, None where no item of it could be shared; the items it
    took from `items[start:]`; the records in it). An entry ends at MAX_RECORDS records
    or before its records would pass `max_batch_bytes`. Token ids go out only with the
    writer's `fingerprint` (its buffer takes none without one)."""
    limit = max_batch_bytes(max_chars)
    records: list[bytes] = []
    size, i = 0, start
    while i < len(items) and len(records) < MAX_RECORDS:
        item = items[i]
        if type(item) is bytes:
            record: bytes | None = item
        else:
            worker_id, key = item
            if type(key) is not TokenKey:
                record = text_record(worker_id, key, max_chars)
            elif fingerprint is not None:
                record = token_record(worker_id, key, fingerprint, max_chars)
            else:
                record = None  # ids no replica could name
        if record is not None:
            if records and size + len(record) > limit:
                break  # the next entry's first
            records.append(record)
            size += len(record)
        i += 1
    return (pack(header, records) if records else None), i - start, len(records)


class Refused(NamedTuple):
    """A record dropped alone: where it is counted (`sync_decisions`, `sync_sessions`)
    and why."""

    source: str
    why: str


Record = tuple[str, Key] | SessionEntry | Refused


class SyncBatchReader:
    """Decodes batch entries for one replica: its `sync_max_chars` and tokenizer
    fingerprint (None: its tree keys on text and takes no ids)."""

    def __init__(self, max_chars: int, fingerprint: str | None) -> None:
        self.max_bytes = max_batch_bytes(max_chars)
        self.max_key_bytes = 4 * max_chars  # a decision's, as before batches
        self.fingerprint = fingerprint.encode() if fingerprint is not None else None
        self._workers: dict[bytes, str] = {}  # raw worker id -> checked

    def read(self, value: object) -> list[Record]:
        """The records of one entry, in order, each decoded or `Refused`. ValueError when
        the entry is refused whole (too large, not zlib, inflating past `max_batch_bytes`,
        truncated, over MAX_RECORDS records, a record cut off): nothing of it applies."""
        if not isinstance(value, bytes) or len(value) > self.max_bytes + 1024:
            raise ValueError("batch too large")  # zlib adds a few bytes a 16 KiB block
        start = value.find(SEP) + 1
        if not start:
            raise ValueError("batch without a replica id")
        inflate = zlib.decompressobj()
        try:
            body = inflate.decompress(memoryview(value)[start:], self.max_bytes)
        except zlib.error:
            raise ValueError("malformed batch (not zlib)") from None
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError("batch over its bound once decompressed, or truncated")
        spans = []  # framed first: counted and checked before any record is decoded
        pos, end, head = 0, len(body), _HEAD.size
        while pos < end:
            if len(spans) == MAX_RECORDS:
                raise ValueError(f"batch of more than {MAX_RECORDS} records")
            if pos + head > end:
                raise ValueError("batch record cut off")
            kind, n = _HEAD.unpack_from(body, pos)
            pos += head
            if pos + n > end:
                raise ValueError("batch record cut off")
            spans.append((kind, pos, pos + n))
            pos += n
        if not spans:
            raise ValueError("empty batch")
        return [self._record(kind, body[a:b]) for kind, a, b in spans]

    def _record(self, kind: bytes, body: bytes) -> Record:
        worker, sep, payload = body.partition(SEP)
        try:
            if not sep:
                raise ValueError("record without a worker id")
            worker_id = self._workers.get(worker) or self._check(worker)
            if kind == TEXT:
                if len(payload) > self.max_key_bytes:
                    raise ValueError("over sync_max_chars")
                return worker_id, payload.decode("utf-8", "replace")
            if kind == TOKENS:
                fp, colon = (
                    payload[:FINGERPRINT_LEN],
                    payload[FINGERPRINT_LEN : FINGERPRINT_LEN + 1],
                )
                if colon != b":":
                    raise ValueError("token record without a fingerprint")
                if fp != self.fingerprint:
                    raise ValueError(OTHER_TOKENIZER)
                ids = payload[FINGERPRINT_LEN + 1 :]
                if len(ids) > self.max_key_bytes:
                    raise ValueError("over sync_max_chars")
                return worker_id, ids_of(ids)
            if kind == SESSION:
                if len(body) > SESSION_MAX_BYTES:
                    raise ValueError("session entry too large")
                return session_of(worker_id, payload)
            # A later version's kind: it adds one only where a reader may skip it.
            raise ValueError("unknown record kind")
        except ValueError as e:
            return Refused("sync_sessions" if kind == SESSION else "sync_decisions", str(e))

    def _check(self, worker: bytes) -> str:
        worker_id = worker_of(worker)
        if len(self._workers) >= _MEMO_MAX:
            self._workers.clear()
        self._workers[worker] = worker_id
        return worker_id
