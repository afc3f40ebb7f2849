"""The one request-body reader of both services: bytes in, a checked JSON object out.

What a client can send, and what it gets back:

- `Content-Length` or chunked: either is read to its end, at most `limit` bytes (413
  beyond), within `deadline` seconds (408, connection closed). Callers read the body
  *before* taking an admission slot, so a client that trickles its body holds a socket
  for at most `deadline` and never a slot (issue 15: six trickling clients against
  `max_concurrent 4` had every other client refused for as long as they stayed open).
- `Content-Encoding: gzip` or `deflate`: decoded (aiohttp's parser inflates as it
  reads, in bounded pieces, so a bomb costs at most `limit` bytes before the 413) and
  the *decoded* body is what callers get and the router forwards, without the header.
  The declared length is then the compressed one, so it is never used to read. Any
  other encoding is refused with 415 rather than passed on: a worker would have to
  decode what the router did not check.
- JSON is parsed into an object (400 otherwise). Then two checks that the request
  models cannot make, in one pass that runs only when the body could fail either (the
  common request pays a byte search, and a walk over its few numbers where orjson
  parsed it, else one pass of bytes.translate):
  - every string must be encodable as UTF-8: `"\\ud800"` is valid JSON but a lone
    surrogate, which every tokenizer fails on (it was a 500 from each worker, and three
    such requests opened every breaker);
  - every integer must fit in 64 bits (the widest the schema allows; pydantic checks
    the tighter bounds of each field): a 5,000-digit integer made `json.loads` raise a
    ValueError that no one caught (500 on both services).
  Both answer 400 naming the field (`messages.0.content.1.text`).
- A body over LARGE_BODY_BYTES is parsed off the common path (issue 30: three clients
  sending 10 MB prompts again and again held `/health` at 120 ms p50, 320 ms p99): the
  byte checks run in slices of SLICE_BYTES with the event loop free between, and at most
  LARGE_AT_ONCE such bodies are parsed at a time per event loop; the others wait their
  turn in arrival order. Waiting is not refused: each waiting body is already read (the
  connection limit times max_body_bytes bounds them), and load never answers 503 (the
  fleet queue's rule). A thread would not help:
  orjson, json and bytes.translate all hold the GIL. What stays one step is the parse
  itself, ~3 ms a MB here (orjson), so a 16 MB body ~50 ms. Small bodies (the hot path)
  are parsed as before, inline.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shared.serving import json_codec
from shared.serving.errors import APIError
from shared.serving.http import request_key

DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only then can a string fail to
# encode. Looked for with two substring searches first: a regular expression over the
# whole body (it also hunted 19-digit runs) cost 12% of the router's CPU per request
# (py-spy, 1,800-char prompts); long integers are caught by the parser's hook instead.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
# A 64-bit overflow needs a run of 19+ digits. It is looked for by mapping every digit
# to "0" and every other byte to " " (bytes.translate) and searching for 19 zeros: 1.0 us
# on a 1.8 kB body. The regular expression [0-9]{19} it replaces took 11 us there, and
# the digit count that was meant to spare it did not: any prompt with 19 digits in all
# (a date, a few numbers) paid it. Only then is the parser's integer hook used: a Python
# call per integer literal costs ~1 ms on a prompt of 8k token ids.
_DIGIT_MASK = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19
_MAX_INT_DIGITS = 20  # longer integers are not parsed at all (see _bounded_int)
# A body orjson parsed is walked for its numbers instead (`_numbers_exact`) where it has
# at most WALK_VALUES values: ~0.2 us a body of a few fields, whatever its prompt's
# length (the byte check: 1.9 us on a 1.8 kB body, ~8 us on 8 kB). Bounded so a body of
# many values (a prompt of token ids) takes the byte check, and so a walked body nests
# far less deep than the standard library's parser can (its RecursionError, below).
WALK_VALUES = 256
WALK_FROM_BYTES = 512  # shorter: the byte check (~0.3 us) costs what the walk's call does
_FLOAT_BOUND = float(2**63)
LARGE_BODY_BYTES = 1 << 20
SLICE_BYTES = 1 << 20  # ~1.5 ms of translate and search a slice
LARGE_AT_ONCE = 1
# A request whose body came whole with its head, with none of what `read_body` decodes
# (no Content-Encoding) and within the limit, carries it under this key: the router's
# own protocol sets it (router/http/fast_server.py), and a caller parses it as it is
# (`parse_json_object` up to LARGE_BODY_BYTES) rather than read it again.
WHOLE_BODY = request_key("whole_body")


class _TooLarge:
    """Stands in for an integer too long to be worth converting."""


def _bounded_int(digits: str) -> int | _TooLarge:
    return int(digits) if len(digits) <= _MAX_INT_DIGITS else _TooLarge()


def _may_have_surrogate(raw: bytes) -> bool:
    # A one-byte search is a memchr (0.6 us on a 1.8 kB body); the two 3-byte searches it
    # replaces took 10 us there, the regular expression alone 2.5 us (load average 7).
    return b"\\" in raw and _SURROGATE.search(raw) is not None


def _body_error(status: int, message: str, code: str) -> APIError:
    return APIError(status, message, code=code)


async def _read_raw(request: web.Request, limit: int, encoded: bool) -> bytes:
    size = request.content_length
    if size is not None and size > limit:
        raise _body_error(413, f"request body exceeds {limit} bytes", "body_too_large")
    if size == 0:
        return b""
    if size is not None and not encoded:
        # Hot path: a declared length is read in one call (no chunk loop, no copy into a
        # growing buffer); a body cut short is the client's error, not ours.
        try:
            return await request.content.readexactly(size)
        except asyncio.IncompleteReadError:
            raise _body_error(400, "request body ended early", "invalid_body") from None
    body = bytearray()
    async for chunk in request.content.iter_chunked(65536):
        body += chunk
        if len(body) > limit:
            raise _body_error(413, f"request body exceeds {limit} bytes", "body_too_large")
    return bytes(body)


async def read_body(request: web.Request, limit: int, deadline: float) -> bytes:
    """The decoded request body; APIError 408/413/415/400 as the module says."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in DECODED_ENCODINGS:
        raise APIError(
            415, f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none",
            code="unsupported_content_encoding",
        )  # fmt: skip
    encoded = encoding not in ("", "identity")
    try:
        if request.content.is_eof():
            # Hot path: the whole body came with the headers, nothing to wait for (an
            # asyncio.timeout costs a timer handle per request).
            size = request.content_length
            if not encoded and size is not None and 0 < size <= limit:
                # `_read_raw`'s one read of a declared length, inlined: one coroutine
                # less per request.
                try:
                    return await request.content.readexactly(size)
                except asyncio.IncompleteReadError:
                    raise _body_error(400, "request body ended early", "invalid_body") from None
            return await _read_raw(request, limit, encoded)
        async with asyncio.timeout(deadline):
            return await _read_raw(request, limit, encoded)
    except TimeoutError:
        # aiohttp answers, then reads (and drops) what still comes for at most its
        # lingering time (10 s) before it closes the connection; no slot is held.
        raise APIError(
            408, f"request body not received within {deadline:g} s", code="body_timeout"
        ) from None
    except (HttpProcessingError, web.RequestPayloadError):  # bad gzip, bad chunk framing
        raise _body_error(
            400, f"request body is not valid {encoding or 'chunked'} data", "invalid_body"
        ) from None


def _field(path: list[str | int]) -> str | None:
    return ".".join(map(str, path)) or None  # None: a key of the top-level object


def _check_values(data: dict[str, Any]) -> None:
    """Walk the parsed body (iteratively: it may nest as deep as the parser allows)."""
    stack: list[tuple[Any, list[str | int]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = _field(path)
                raise APIError(
                    400, f"{param or 'a field name'}: text must be valid Unicode; a lone surrogate such as "
                    "\\ud800 cannot be encoded as UTF-8", param=param, code="invalid_value",
                ) from None  # fmt: skip
        elif isinstance(value, _TooLarge) or (
            type(value) is int and not INT_MIN <= value <= INT_MAX
        ):
            param = _field(path)
            raise APIError(
                400, f"{param}: integer out of range (64-bit signed at most)",
                param=param, code="invalid_value",
            )  # fmt: skip
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, [*path, key]))
        elif isinstance(value, list):
            stack.extend((item, [*path, i]) for i, item in enumerate(value))


def _numbers_exact(data: dict[str, Any]) -> bool | None:
    """Whether orjson held every number of `data` exactly: no int outside 64 bits, no
    float of 2**63 or more in size (orjson turns an integer literal past 64 bits into
    one). None: more than WALK_VALUES values, not walked (the byte check decides)."""
    budget = WALK_VALUES
    stack: list[Any] = [data.values()]
    while stack:
        values = stack.pop()
        budget -= len(values)
        if budget < 0:
            return None
        for value in values:
            kind = type(value)
            if kind is str:
                continue
            if kind is int:
                if not INT_MIN <= value <= INT_MAX:
                    return False
            elif kind is float:
                if not -_FLOAT_BOUND < value < _FLOAT_BOUND:
                    return False
            elif kind is dict:
                stack.append(value.values())
            elif kind is list:
                stack.append(value)
    return True


def parse_json_object(
    raw: bytes, may_overflow: bool | None = None, may_surrogate: bool | None = None
) -> dict[str, Any]:
    """`raw` as a checked JSON object, or a 400 APIError saying what is wrong with it.
    `may_overflow` / `may_surrogate`: the byte checks' answers when already known
    (`parse_large`); None: made here."""
    if may_surrogate is None:  # `_may_have_surrogate`, inlined: one call less a body
        may_surrogate = b"\\" in raw and _SURROGATE.search(raw) is not None
    if may_overflow is None and len(raw) >= WALK_FROM_BYTES:
        # orjson first: its numbers say whether an integer literal lost digits, at a
        # cost per value rather than per byte (the byte check below costs ~1 us a kB).
        try:
            data = json_codec.loads(raw)
        except json_codec.JSONDecodeError:
            data = None
        if type(data) is dict:
            exact = _numbers_exact(data)
            if exact or (exact is None and _LONG_RUN not in raw.translate(_DIGIT_MASK)):
                if may_surrogate:
                    _check_values(data)
                return data
        # Refused, not an object, or a number that may have lost digits: as before.
        may_overflow = _LONG_RUN in raw.translate(_DIGIT_MASK)
    elif may_overflow is None:  # a short body: the byte check is as cheap as the walk
        may_overflow = _LONG_RUN in raw.translate(_DIGIT_MASK)
    if not may_overflow:
        # The common body: orjson from the bytes (shared/serving/json_codec.py). What it
        # refuses takes the standard library's path below, which says what is wrong.
        try:
            data = json_codec.loads(raw)
        except json_codec.JSONDecodeError:
            pass
        else:
            if not isinstance(data, dict):
                raise APIError(400, "request body must be a JSON object", code="invalid_json")
            if may_surrogate:
                _check_values(data)
            return data
    long_ints: list[str] = []

    def parse_int(digits: str) -> int | _TooLarge:  # (made here: the common body needs none)
        if len(digits) < 19:  # fits in 64 bits, sign included
            return int(digits)
        long_ints.append(digits)
        return _bounded_int(digits)

    try:
        text = raw.decode("utf-8")
        data = json.loads(text, parse_int=parse_int) if may_overflow else json.loads(text)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"request body is not valid JSON: {e.msg} at position {e.pos}", code="invalid_json"
        ) from None
    except RecursionError:  # json's parser recurses per nesting level
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if long_ints or may_surrogate:
        _check_values(data)
    return data


# The large bodies parsed at once, per event loop.
_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


async def _sliced_search(raw: bytes, found: Any, overlap: int) -> bool:
    """Whether `found(piece)` holds for any SLICE_BYTES piece of `raw` (each overlapping
    the one before by `overlap` bytes, so no match straddles two), the loop free between."""
    for start in range(0, len(raw), SLICE_BYTES):
        if found(raw[max(0, start - overlap) : start + SLICE_BYTES]):
            return True
        await asyncio.sleep(0)
    return False


async def parse_large(raw: bytes) -> dict[str, Any]:
    """`parse_json_object` for a body over LARGE_BODY_BYTES (the module says how)."""
    gate = _GATES.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(LARGE_AT_ONCE))
    async with gate:
        overflow = await _sliced_search(
            raw, lambda piece: _LONG_RUN in piece.translate(_DIGIT_MASK), len(_LONG_RUN) - 1
        )
        surrogate = await _sliced_search(raw, _may_have_surrogate, 3)  # \ud8 before the last
        return parse_json_object(raw, overflow, surrogate)


async def read_json(request: web.Request, limit: int, deadline: float) -> tuple[bytes, dict]:
    """The decoded body (what the router forwards) and its checked JSON object."""
    raw = await read_body(request, limit, deadline)
    if len(raw) > LARGE_BODY_BYTES:
        return raw, await parse_large(raw)
    return raw, parse_json_object(raw)
