"""The simplest answer a worker sends, read by one pattern instead of httptools' callbacks.

A callback into Python per header line was most of an exchange's cost
(router/upstream/connection.py reads every answer through httptools otherwise). Only an
answer no rule of the parser or of the connection could treat otherwise is read here:

- whole in one read: the head, then exactly Content-Length bytes of body, nothing more;
- `HTTP/1.1`, a status of 200-599 but 204 and 304 (they have no body whatever the
  headers say), a reason of visible ASCII;
- at most 121 lines of token names and values of visible ASCII and spaces (the spaces
  after the colon are not the value's; trailing ones are, as in llhttp);
- exactly one Content-Length of at most 15 digits, and none of the names that change the
  framing or the connection (Transfer-Encoding, Connection, Proxy-Connection, Upgrade,
  Keep-Alive);
- the whole head under every field cap (`max_head`: router/upstream/limits.py's
  MAX_FIELD_BYTES, as the connection passes it), so no cap can differ.

Anything else (chunked, a split head, a 1xx, obs-fold, a tab, one byte more) is the
parser's, as before. `tests/router/upstream/test_simple_heads.py` runs the conformance
suite's answers, edge heads and random ones through both readers and compares every
outcome.
"""

from __future__ import annotations

import re

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_SPECIAL = r"(?i:transfer-encoding|content-length|connection|proxy-connection|upgrade|keep-alive):"
_LINE = rf"(?!{_SPECIAL}){_TOKEN}: *[!-~][ -~]*\r\n"
_HEAD = re.compile(
    rf"HTTP/1\.1 ([2-5][0-9][0-9]) [!-~][ -~]*\r\n"
    rf"((?:{_LINE}){{0,60}}(?i:content-length): *([0-9]{{1,15}})\r\n(?:{_LINE}){{0,60}})\r\n"
)
_FIELD = re.compile(r"([^:\r\n]+): *([^\r\n]+)\r\n")  # a line `_HEAD` admitted


def simple_answer(
    data: bytes, max_head: int
) -> tuple[int, list[tuple[str, str]], int, bytes] | None:
    """(status, header fields in order, Content-Length, body) when `data` is one whole
    answer of the simplest form with a head of at most `max_head` bytes (the connection
    passes the field cap: under it no cap can differ); None for anything else."""
    end = data.find(b"\r\n\r\n") + 4
    if end < 4 or end > max_head:
        return None
    head = data[:end].decode("latin-1")  # the pattern admits ASCII only
    found = _HEAD.fullmatch(head)
    if found is None or found[1] in ("204", "304"):
        return None
    body = data[end:]
    length = int(found[3])
    if len(body) != length:
        return None
    return int(found[1]), _FIELD.findall(found[2]), length, body
