"""What replica sync reads from Redis, checked: other replicas' decisions and loads.

Anyone who can write to Redis can write these, so each is parsed as untrusted input and
what does not fit is dropped with the reason (the caller counts and logs it; a bad
entry never stops a loop):

- a decision is one stream field `replica id SEP worker id SEP zlib(text)`, at most a
  few bytes over what `sync_max_chars` allows; its worker id must have the registry's
  shape, and it is inflated to at most 4 bytes a character (a 146 KB zlib bomb once
  inflated to 200 MB in a router);
- a load hash maps worker ids to integer in-flight counts, each clamped to what one
  replica can have in flight (`max_concurrent`): a fake `{w1: 1000000}` steered all
  traffic away from w1, and a "1.5" broke the load loop every round.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from shared.peers import WORKER_ID

# One stream field per decision, `replica id SEP worker id SEP zlib(text)`: a single
# field costs redis-py a third of the packing and parsing of three. Ids hold no NUL.
SEP = b"\x00"


def encode_decision(header: bytes, worker_id: str, text: str, max_chars: int) -> bytes:
    payload = zlib.compress(text[:max_chars].encode("utf-8", "replace"), 1)
    return header + worker_id.encode() + SEP + payload


def decode_decision(entry: object, max_chars: int) -> tuple[str, str]:
    """(worker id, text) of one stream entry; ValueError saying why it is refused."""
    max_text = 4 * max_chars  # UTF-8 takes at most 4 bytes a character
    if not isinstance(entry, bytes) or len(entry) > max_text + 1024:
        raise ValueError("entry too large")  # zlib adds a few bytes a 16 KiB block
    try:
        _replica, worker, payload = entry.split(SEP, 2)
        worker_id = worker.decode()
        if not WORKER_ID.fullmatch(worker_id):
            raise ValueError("bad worker id")
        inflate = zlib.decompressobj()
        raw = inflate.decompress(payload, max_text)
    except (zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed entry ({type(e).__name__})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError("text over sync_max_chars once decompressed, or truncated")
    return worker_id, raw.decode("utf-8", "replace")


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
