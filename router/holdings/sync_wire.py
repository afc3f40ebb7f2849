"""What replica sync reads from Redis, checked: other replicas' decisions and loads.

Anyone who can write to Redis can write these, so each is parsed as untrusted input and
what does not fit is dropped with the reason (the caller counts and logs it; a bad
entry never stops a loop):

- a batch (this version's only writing, router/holdings/sync_batch.py) is one stream
  field `b`, one replica's flush: `replica id SEP zlib(record ...)`, each record
  `KIND (1 byte) + body length (uint32 little-endian) + body`, the body `worker id SEP
  payload`; KIND `d` a decision on text (payload: UTF-8 text), `t` one on token ids
  (payload: `fingerprint : uint32 little-endian ids`, not compressed on its own), `s` a
  session entry (payload: `digest KIND pin-ms [LATER ...]`, as below). One zlib stream a
  flush, not one a decision: a batch repeats the same long prefixes, and one XADD of one
  field replaces an XADD and a reply parse per decision. Bounds, checked before any
  record is applied: the field at most `max_batch_bytes` (1 MiB, or 4 x `sync_max_chars`
  + 1 KiB where that is more: the bound one entry of the version before had, 4 bytes a
  char or an id) plus zlib's overhead, inflated to at most `max_batch_bytes`, at most
  `MAX_RECORDS` records, each whole; else the batch is dropped whole (counted). A
  record whose body does not pass the checks below (its text or ids at most 4 x
  `sync_max_chars` bytes, as one entry's before) is dropped alone (counted) and the rest
  applied; a KIND this reader does not know (a later version's) likewise.
  Rolling upgrade: this version still reads the fields `d` and `s` below (the versions
  before batches wrote an entry per decision); those versions read a batch entry as a
  decision with no payload and drop it (counted in `sync_decisions`, no crash): while
  they run they learn nothing from the batching replicas, which learn from them;
- a decision of the versions before batches is one stream field `d`, `replica id SEP
  worker id SEP payload`, at most a few bytes over what `sync_max_chars` allows; its
  worker id must have the registry's shape. The payload is what the writer's tree keys
  on (router/holdings/tree.py):
    text    `zlib(utf-8 text)`, inflated to at most 4 bytes a character (a 146 KB zlib
            bomb once inflated to 200 MB in a router);
    tokens  `TOKENS fingerprint : zlib(uint32 little-endian ids)` when the router has a
            `tokenizer`: inflated to at most 4 bytes an id, a whole number of ids, each
            a valid token id, and the fingerprint (shared/tokens/fingerprint.py) must
            be the reader's own: ids of another tokenizer would pollute its tree. The
            inflated bytes are the tree's TokenKey as they are (Latin-1, a char a byte:
            shared/tokens/prompt_ids.py): written with one encode, read with one decode,
            no int per id.
  Both are capped at `sync_max_chars` elements (chars, or ids). A reader of the version
  before tokens (text only) fails to inflate a token payload (`T` is no zlib header) and
  drops it as malformed, so a rolling upgrade never puts ids into a text tree.
  Compatibility with the version that keyed ids as tuples (same format): either reads
  the other's token entries. A request a router on ids keys by its text (no ids for it:
  its UTF-8 bytes behind the id TEXT_IN_IDS, router/holdings/namespace.py) is shared
  only where those bytes are whole ids in range (ASCII, a multiple of 4 bytes); else
  not at all, where that version shared it as text, which replicas on ids skip;
- a session entry of the versions before batches is one stream field `s`, `replica id SEP
  worker id SEP digest KIND pin-ms [LATER ...]` (a batch's `s` record is its part from the
  worker id on), the whole at most `SESSION_MAX_BYTES` (checked before anything is split): the digest exactly
  `DIGEST_BYTES` long (router/holdings/sessions.py), the worker id of the registry's
  shape, KIND `p` (the session was placed there: a first call or a move) or `k` (kept
  there by a call that asked for a pin), pin-ms the call's ``cache_pin_ttl`` in
  milliseconds, ASCII digits, at most `MAX_PIN_MS` (the request schema's bound, 86,400
  s): the other replicas then know how long the session's context is held (rule 3 of
  the session rule). An entry with nothing after the digest is the version before
  pins': placed, no pin. A reader of that version drops the longer entries (a bad
  digest, counted): during a rolling upgrade it learns no sessions from the new
  replicas.
  Forward compatible from this version on: a later version adds its fields after
  pin-ms behind `LATER` (`;`, never a digit), and a reader takes the fields it knows
  and ignores the rest, within SESSION_MAX_BYTES. A field may be added so only where
  a reader that ignores it still acts rightly on the entry; a change it must not
  ignore takes a new KIND, which readers that do not know it drop (counted). The
  versions before this rule (pin-ms the last field) read `;` as a bad pin TTL and drop
  such entries, counted: while they run, they learn no sessions from later replicas;
- a load hash maps worker ids to integer in-flight counts, each clamped to what one
  replica can have in flight (`max_concurrent`): a fake `{w1: 1000000}` steered all
  traffic away from w1, and a "1.5" broke the load loop every round.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from shared.tokens.fingerprint import FINGERPRINT_LEN
from shared.tokens.prompt_ids import (
    KEY_WIDTH,
    MAX_ID,
    TokenKey,
    ids_in_range,
    key_of_wire,
    token_key,
)
from shared.wire.peers import WORKER_ID

# Parts of an entry or a record: one field costs redis-py a third of the packing and
# parsing of three. Ids hold no NUL.
SEP = b"\x00"
# Leads a token payload; a zlib stream starts with 0x?8 (deflate), never with `T`.
TOKENS = b"T"
MAX_TOKEN_ID = MAX_ID  # as in KV events (shared/wire/kv_events.py)

Key = str  # what a tree keys on: text, or a TokenKey
SESSION_MAX_BYTES = 512  # a replica id, a worker id, a digest and a pin fit well within
DIGEST_BYTES = 16  # a session's key, hashed with its tenant (router/holdings/sessions.py)
PLACED, KEPT = b"p", b"k"  # a session entry's kind
LATER = b";"  # a session entry's fields of later versions follow (ignored)
MAX_PIN_MS = 86_400_000  # shared/wire/protocol.py's PinTtl bound, in milliseconds
# Counted apart from garbage: a replica with another tokenizer or model.
OTHER_TOKENIZER = "token ids of another tokenizer (fingerprint differs)"


class SessionEntry(NamedTuple):
    """One session entry, decoded: where a replica placed or kept a session, and the pin
    its call asked for there (seconds, 0: none)."""

    digest: bytes
    worker_id: str
    pin_ttl: float = 0.0
    placed: bool = True


def encode_session(
    header: bytes, worker_id: str, digest: bytes, pin_ttl: float = 0.0, placed: bool = True
) -> bytes:
    ms = min(max(round(pin_ttl * 1000), 0), MAX_PIN_MS)
    kind = PLACED if placed else KEPT
    return header + worker_id.encode() + SEP + digest + kind + str(ms).encode()


def worker_of(raw: bytes) -> str:
    """A worker id of the registry's shape; ValueError otherwise."""
    worker_id = raw.decode("utf-8", "replace")
    if not WORKER_ID.fullmatch(worker_id):
        raise ValueError("bad worker id")
    return worker_id


def decode_session(entry: object) -> SessionEntry:
    """One session entry; ValueError saying why it is refused."""
    if not isinstance(entry, bytes) or len(entry) > SESSION_MAX_BYTES:
        raise ValueError("session entry too large")
    parts = entry.split(SEP, 2)  # the digest may hold NUL bytes: it comes after the ids
    if len(parts) != 3:
        raise ValueError("malformed session entry")
    return session_of(worker_of(parts[1]), parts[2])


def session_of(worker_id: str, rest: bytes) -> SessionEntry:
    """A session entry's fields after its worker id; ValueError saying why it is refused."""
    digest, tail = rest[:DIGEST_BYTES], rest[DIGEST_BYTES:]
    if len(digest) != DIGEST_BYTES:
        raise ValueError("bad session digest")
    if not tail:  # the version before pins: a placement
        return SessionEntry(digest, worker_id)
    kind = tail[:1]
    ms = tail[1:].partition(LATER)[0]  # a later version's fields after it: ignored
    if kind not in (PLACED, KEPT):
        raise ValueError("bad session digest, or an unknown kind after it")
    # bytes.isdigit is ASCII digits only; the length bound keeps int() short.
    if not ms.isdigit() or len(ms) > len(str(MAX_PIN_MS)) or int(ms) > MAX_PIN_MS:
        raise ValueError("bad pin TTL")
    return SessionEntry(digest, worker_id, int(ms) / 1000, kind == PLACED)


def encode_decision(header: bytes, worker_id: str, text: str, max_chars: int) -> bytes:
    """An entry of the versions before batches (what a replica of those writes: tests
    and the sync-wire bench's before arm)."""
    payload = zlib.compress(text[:max_chars].encode("utf-8", "replace"), 1)
    return header + worker_id.encode() + SEP + payload


def packed_ids(ids: TokenKey | Sequence[int] | np.ndarray, max_ids: int) -> bytes | None:
    """At most `max_ids` ids as uint32 little-endian bytes. None when one is not a token
    id (< 0 or >= 2**31: a client's token-id prompt can hold anything; the worker
    answers it, the other replicas need not learn it)."""
    key = ids if type(ids) is TokenKey else token_key(ids[:max_ids])
    if not key:
        return None
    packed = key[: KEY_WIDTH * max_ids].encode("latin-1")
    if len(packed) % KEY_WIDTH or not ids_in_range(packed):
        return None  # a text key in a tree on ids (router/holdings/room.py): not ids
    return packed


def encode_tokens(
    header: bytes, worker_id: str, ids: TokenKey | Sequence[int] | np.ndarray,
    fingerprint: str, max_ids: int,
) -> bytes | None:  # fmt: skip
    """A decision keyed on prompt ids, as the versions before batches write it: 4 bytes
    an id before zlib. None where `packed_ids` is."""
    packed = packed_ids(ids, max_ids)
    if packed is None:
        return None
    return header + worker_id.encode() + SEP + TOKENS + fingerprint.encode() + b":" + (
        zlib.compress(packed, 1)
    )  # fmt: skip


def ids_of(raw: bytes) -> TokenKey:
    """The key of a payload's uint32 little-endian ids; ValueError saying why not."""
    if not raw or len(raw) % 4:
        raise ValueError("token payload is not a whole number of ids")
    if not ids_in_range(raw):
        raise ValueError("token id out of range")
    return key_of_wire(raw)


def decode_decision(
    entry: object, max_chars: int, fingerprint: str | None = None
) -> tuple[str, Key]:
    """(worker id, text or token ids) of one stream entry of the versions before batches;
    ValueError saying why it is refused. `fingerprint`: this reader's tokenizer (None: it
    keys on text, and takes no ids)."""
    max_bytes = 4 * max_chars  # UTF-8 takes at most 4 bytes a character; an id, 4
    if not isinstance(entry, bytes) or len(entry) > max_bytes + 1024:
        raise ValueError("entry too large")  # zlib adds a few bytes a 16 KiB block
    try:
        _replica, worker, payload = entry.split(SEP, 2)
        worker_id = worker.decode()
        if not WORKER_ID.fullmatch(worker_id):
            raise ValueError("bad worker id")
        tokens = payload.startswith(TOKENS)
        if tokens:
            head = len(TOKENS) + FINGERPRINT_LEN
            theirs = payload[len(TOKENS) : head]
            if payload[head : head + 1] != b":":
                raise ValueError("token entry without a fingerprint")
            if fingerprint is None or theirs != fingerprint.encode():
                raise ValueError(OTHER_TOKENIZER)
            payload = payload[head + 1 :]
        inflate = zlib.decompressobj()
        raw = inflate.decompress(payload, max_bytes)
    except (zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed entry ({type(e).__name__})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError("over sync_max_chars once decompressed, or truncated")
    if not tokens:
        return worker_id, raw.decode("utf-8", "replace")
    return worker_id, ids_of(raw)


def add_loads(
    remote: dict[str, int], counts: Mapping[object, object], known: Mapping[str, int], cap: int
) -> list[str]:
    """Add one replica's in-flight counts for workers in `known` to `remote`, each clamped
    to [0, cap]; returns the reasons for the entries dropped."""
    dropped = []
    for worker, count in counts.items():
        wid = worker.decode("utf-8", "replace") if isinstance(worker, bytes) else str(worker)
        try:
            value = int(count)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            dropped.append(f"{wid[:40]!r}: count is not an integer")
            continue
        if wid in known:
            remote[wid] = remote.get(wid, 0) + min(max(value, 0), cap)
    return dropped
