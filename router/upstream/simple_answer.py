"""The simplest answer a worker sends, read by one pattern instead of httptools' callbacks.

A callback into Python per header line was most of an exchange's cost
(router/upstream/answer_reader.py reads every answer through httptools otherwise). Only an
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

**A repeated head** (`SimpleReader`, one a connection): a worker's head is mostly the
same every answer; what changes is the echo of the request id and the Content-Length.
After a head the pattern took, the reader keeps it with those two values as holes; the
next answer whose head is those same bytes with this request's id and its own body's
length in the holes is taken without the pattern (the pattern's result for it is known:
the same lines with the two values). The id filled in must be a value the pattern
admits (visible ASCII and spaces, no space first), so no byte of it can change a line.
Any other head (a Date that moved on, another header) is read by the pattern, and is
kept for the next one in turn: one head a connection, at most `max_head` bytes.
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


_ECHO = "x-request-id"
SKIP_AFTER_MISS = 16  # heads read plainly after a kept head was not repeated


class SimpleReader:
    """`simple_answer` for one connection, remembering its last head (see above)."""

    __slots__ = (
        "_fields",
        "_hit",
        "_holes",
        "_id_at",
        "_length_at",
        "_status",
        "_wait",
        "max_head",
    )

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        # The last head: the bytes around its two holes, which hole comes first (True:
        # the id), its status and fields, and where the two holes' fields are in them.
        self._holes: tuple[bytes, bytes, bytes, bool] | None = None
        self._status = 0
        self._fields: list[tuple[str, str]] = []
        self._id_at = self._length_at = 0
        self._hit = False  # the head kept was repeated at least once
        self._wait = 0  # heads read before one is kept again (a head kept for nothing)

    def read(
        self, data: bytes, request_id: str
    ) -> tuple[int, list[tuple[str, str]], int, bytes] | None:
        """`simple_answer(data, max_head)` of an answer to the request that sent
        `request_id`: the same result, without the pattern for a repeated head."""
        holes = self._holes
        if holes is not None:
            # An id the pattern admits as a value: visible ASCII and spaces, a visible first.
            if request_id.isascii() and request_id.isprintable() and request_id[:1] > " ":
                end = data.find(b"\r\n\r\n") + 4
                if 4 <= end <= self.max_head:
                    length = len(data) - end
                    before, between, after, id_first = holes
                    rid, digits = request_id.encode("ascii"), b"%d" % length
                    head = (
                        before + rid + between + digits + after
                        if id_first
                        else before + digits + between + rid + after
                    )
                    if len(head) == end and data.startswith(head):
                        self._hit = True
                        fields = self._fields.copy()
                        fields[self._id_at] = (fields[self._id_at][0], request_id)
                        fields[self._length_at] = (fields[self._length_at][0], str(length))
                        return self._status, fields, length, data[end:]
            if not self._hit:
                # Keeping it cost about a pattern's read: a worker whose head changes
                # every answer (a per-answer header) has the next few read plainly.
                self._wait = SKIP_AFTER_MISS
        answer = simple_answer(data, self.max_head)
        if self._wait:
            self._wait -= 1
            self._holes = None
        else:
            self._holes = None if answer is None else self._keep(data, answer, request_id)
            self._hit = False
        return answer

    def _keep(
        self, data: bytes, answer: tuple[int, list[tuple[str, str]], int, bytes],
        request_id: str,
    ) -> tuple[bytes, bytes, bytes, bool] | None:  # fmt: skip
        """The holes of a head the pattern took, when it echoes `request_id` on exactly
        one line (None: nothing is kept). Found from its fields, not by the pattern again:
        a field's line is the only one that begins `\\r\\n<its name>:` (the names are
        unique here, and no value holds CR or LF), and its value begins at the first
        character after the colon that is not a space."""
        status, fields, _, body = answer
        echo_at = length_at = -1
        for i, (name, value) in enumerate(fields):
            low = name.lower()
            if low == _ECHO:
                if echo_at >= 0 or value != request_id:
                    return None
                echo_at = i
            elif low == "content-length":  # (exactly one: the pattern's)
                length_at = i
        if echo_at < 0:
            return None
        head = data[: len(data) - len(body)]
        spans = []
        for at in (echo_at, length_at):
            name, value = fields[at]
            colon = head.find(b"\r\n%s:" % name.encode("ascii")) + len(name) + 3
            start = head.find(value.encode("ascii"), colon)
            spans.append((start, start + len(value)))
        self._status, self._fields = status, fields.copy()
        self._id_at, self._length_at = echo_at, length_at
        first, second = sorted(spans)
        return (
            head[: first[0]], head[first[1] : second[0]], head[second[1] :],
            spans[0] < spans[1],
        )  # fmt: skip
