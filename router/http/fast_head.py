"""The request heads the router's own protocol answers itself (router/http/fast_server.py,
whose docstring states the rule), and a connection's last one.

`read_head` reads a head by the rule: (path, headers, body size), or None where the
request is aiohttp's. Its answer depends on the head's bytes and `max_body` alone, so a
connection keeps the last head it took (`LastHead`) and does not read it again:

- the same bytes again (a client on a kept connection sending the same request head:
  wrk, a benchmark, a poller): the same answer, the same headers object (read-only,
  shared by those requests);
- the same bytes but for the Content-Length value (the OpenAI client, any client whose
  bodies differ in size): the rule checks nothing of that value but that it is digits
  (with OWS about them) no larger than `max_body`, so the answer is the last one with
  that value in place, the headers copied with it (the name as this head spells it).

Anything else is read anew. Whether the body came whole (exactly Content-Length bytes,
nothing after) is the caller's to check, per request.
"""

from __future__ import annotations

import re

from multidict import CIMultiDict, CIMultiDictProxy

# (path, headers, body size): what a head a fast answer may take holds.
Found = tuple[str, CIMultiDictProxy[str], int]

# The request a fast answer is for, as one strict pattern over its decoded head (line and
# headers, the blank line not included): the exact request line, then header lines of a
# token, a colon and a field of visible characters, spaces and tabs (bytes beyond ASCII
# allowed, as aiohttp allows them), each ending CRLF. Possessive quantifiers keep it
# linear on any input. Anything it refuses is aiohttp's to answer, so it errs strict.
# The field is one character class, not "OWS, a value, OWS": that is the same set of
# strings (any run of those characters splits into the three), and one class is a tight
# loop in the regex engine where the alternation ran a group per character (0.37 against
# 1.15 us on wrk's 3-header head, 1.3 against 4.7 us on the OpenAI client's 15 headers;
# tests/router/http/test_fast_server.py holds the two patterns to one answer).
_NAME = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"
_FIELD = r"[^\x00-\x08\x0a-\x1f\x7f]*+"  # visible, SP, HTAB, beyond ASCII; no CR, LF
_HEAD = re.compile(
    rf"POST (/v1/completions|/v1/chat/completions) HTTP/1\.1\r\n(?:{_NAME}:{_FIELD}\r\n)*+"
)
MAX_HEAD = 8190  # a longer head is aiohttp's, so no single field can pass its limits
MAX_HEADERS = 128  # aiohttp's server: more is 400
# Digits of a Content-Length read here: longer is aiohttp's to refuse (past 4300, `int()`
# itself raises, and a raise in `data_received` would drop the connection unanswered).
MAX_DIGITS = 18
_LENGTH_LINE = b"\r\ncontent-length:"  # lowered; one such line in a head `read_head` took


def read_head(head: bytes, max_body: int) -> Found | None:
    """(path, headers, body size) where `head` (the request line and header lines, each
    ending CRLF: the bytes before the blank line) is one a fast answer may take (the
    rule of router/http/fast_server.py), else None."""
    # As aiohttp decodes a head (UTF-8, undecodable bytes kept as surrogates).
    text = head.decode("utf-8", "surrogateescape")
    line = _HEAD.fullmatch(text)
    if line is None:
        return None
    # The pattern checked every line: each is `name:value` with no CR/LF inside and no
    # colon in the name, so splitting is enough (half a findall's time, a third with
    # the OpenAI client's 10 headers). A plain loop, not a list comprehension over a
    # generator: 0.63 against 1.02 us for wrk's 3 lines, 2.5 against 3.7 for 15 (timeit).
    start = line.end(1) + len(" HTTP/1.1\r\n")
    lines = text[start:-2].split("\r\n") if start < len(text) else ()
    if len(lines) > MAX_HEADERS:
        return None
    fields = []
    for field in lines:
        name, _, value = field.partition(":")
        fields.append((name, value.strip(" \t")))
    headers = CIMultiDict(fields)
    lengths = headers.getall("Content-Length", ())
    if len(lengths) != 1 or len(headers.getall("Host", ())) != 1:
        return None
    length = lengths[0]
    if not (length.isascii() and length.isdigit()) or len(length) > MAX_DIGITS:
        return None
    size = int(length)
    if size > max_body:
        return None
    connection = headers.get("Connection")
    if connection is not None and connection.lower() != "keep-alive":
        return None
    if (
        "Transfer-Encoding" in headers or "Expect" in headers or "Upgrade" in headers
        or "Content-Encoding" in headers or "TE" in headers or "Trailer" in headers
    ):  # fmt: skip
        return None
    return line[1], CIMultiDictProxy(headers), size


class LastHead:
    """A connection's last head taken and `read_head`'s answer for it (the module's
    rule: `head` is b"", no head, until one is taken)."""

    __slots__ = ("_after", "_before", "_name", "found", "head")

    def __init__(self) -> None:
        self.head = b""
        self.found: Found | None = None
        # `head` around its Content-Length value: through the colon, and from the CRLF
        # that ends the line; the name as `head` spells it.
        self._before = self._after = b""
        self._name = ""

    def take(self, head: bytes, max_body: int) -> Found | None:
        """`read_head(head, max_body)`, kept as the last head where it is one (the caller
        has compared `head` with `self.head` already: equal, it reuses `found`)."""
        before, after = self._before, self._after
        if (
            before and head.startswith(before) and head.endswith(after)
            and head.find(b"\r\n", len(before)) == len(head) - len(after)
        ):  # fmt: skip
            # The last head but for the Content-Length value (no CRLF inside it).
            value = head[len(before) : len(head) - len(after)].strip(b" \t")
            if value.isdigit() and len(value) <= MAX_DIGITS and int(value) <= max_body:
                last = self.found  # (bytes' isdigit: ASCII digits only)
                assert last is not None
                length = value.decode()
                headers = CIMultiDict(last[1])
                headers[self._name] = length  # in place, spelled as this head spells it
                found = last[0], CIMultiDictProxy(headers), int(length)
                self.head, self.found = head, found
                return found
        found = read_head(head, max_body)
        if found is not None:
            self.head, self.found = head, found
            at = head.lower().find(_LENGTH_LINE) + len(_LENGTH_LINE)
            end = head.find(b"\r\n", at)
            self._before, self._after = head[:at], head[end:]
            self._name = head[at - len(_LENGTH_LINE) + 2 : at - 1].decode()
        return found


def simple(data: bytes, max_body: int) -> tuple[str, CIMultiDictProxy[str], bytes] | None:
    """(path, headers, body) where `data` is exactly one request a fast answer may take
    (the rule, the body whole and nothing after it), else None: one request's steps of
    `FastProtocol.data_received` with no head kept."""
    end = data.find(b"\r\n\r\n")
    if end < 0 or end > MAX_HEAD:
        return None
    found = read_head(data[: end + 2], max_body)
    if found is None or end + 4 + found[2] != len(data):  # split, or more after it
        return None
    return found[0], found[1], data[end + 4 :]
