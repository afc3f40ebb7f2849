"""A body orjson parsed is walked for its numbers instead of searched byte by byte for a
19-digit run (shared/serving/body.py `_numbers_exact`). Held differentially against the
byte check's own path (`parse_json_object` handed the byte check's answer, the code
every body took before): over generated bodies with long integers, long digit runs in
text, long floats, escapes, NaN and deep nesting, the same object (types too) or the
same 400, word for word."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.serving import body
from shared.serving.body import WALK_VALUES, parse_json_object
from shared.serving.errors import APIError

BIG_INTS = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**18, 10**19,
            -(10**19), 10**30, 10**400]  # fmt: skip
numbers = st.one_of(
    st.integers(), st.sampled_from(BIG_INTS), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e19, -1e19, 9.223372036854775e18, 0.1234567890123456789, 1e-400]),
)  # fmt: skip
texts = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["1234567890123456789", "x 12345678901234567890 y", "\ud800", "\U0001f600",
                     "\udfff\ud800", "a\\u0041"]),
)  # fmt: skip
values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=30,
)
objects = st.dictionaries(texts, values, max_size=6)


@pytest.fixture(autouse=True)
def _walk_every_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated bodies are mostly short: the walk is taken for every one here (a short
    body takes the byte check first in the service: `test_a_short_body_...`)."""
    monkeypatch.setattr(body, "WALK_FROM_BYTES", 0)


def _outcome(raw: bytes, reference: bool) -> Any:
    try:
        if reference:  # the byte check's path, as every body took it before
            may_overflow = body._LONG_RUN in raw.translate(body._DIGIT_MASK)
            return ("ok", parse_json_object(raw, may_overflow))
        return ("ok", parse_json_object(raw))
    except APIError as e:
        return ("error", e.status, e.message, e.param, e.code)


def _same(first: Any, second: Any) -> None:
    """The same value, types too (iteratively: bodies nest past the recursion limit)."""
    stack = [(first, second)]
    while stack:
        a, b = stack.pop()
        assert type(a) is type(b), (a, b)
        if type(a) is dict:
            assert list(a) == list(b)
            stack.extend((a[key], b[key]) for key in a)
        elif type(a) in (list, tuple):
            assert len(a) == len(b)
            stack.extend(zip(a, b, strict=True))
        elif type(a) is float and math.isnan(a):
            assert math.isnan(b)
        elif type(a) is not body._TooLarge:
            assert a == b, (a, b)


def _agrees(raw: bytes) -> None:
    _same(_outcome(raw, reference=False), _outcome(raw, reference=True))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=objects, ascii_only=st.booleans())
def test_generated_bodies_parse_as_the_byte_check_parsed_them(
    data: dict[str, Any], ascii_only: bool
) -> None:
    _agrees(json.dumps(data, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


@settings(max_examples=500, deadline=None)
@given(data=objects, number=st.sampled_from([str(n) for n in BIG_INTS] + ["1e400", "-0",
       "1.00000000000000000000001", "12345678901234567890.5", "NaN", "Infinity"]))  # fmt: skip
def test_a_literal_written_in_place_parses_as_before(data: dict[str, Any], number: str) -> None:
    """Number literals json.dumps would not write (past 64 bits as written, NaN), in
    a body and at its top level."""
    raw = json.dumps(data).encode("utf-8", "surrogatepass")
    _agrees(raw[:-1] + (b", " if data else b"") + b'"n": ' + number.encode() + b"}")
    _agrees(number.encode())
    _agrees(b"[" + number.encode() + b"]")


@pytest.mark.parametrize("depth", [1, 10, WALK_VALUES - 2, WALK_VALUES + 2, 990, 1010, 1020, 2000])
@pytest.mark.parametrize("leaf", [b"1", b"12345678901234567890", b'"12345678901234567890"'])
def test_nested_bodies_parse_as_before(depth: int, leaf: bytes) -> None:
    """Deep bodies: a walked one nests less deep than the standard library's parser can
    go (its RecursionError answers 400), and a deeper one takes the byte check."""
    _agrees(b'{"a": ' + b"[" * depth + leaf + b"]" * depth + b"}")
    _agrees(b'{"a": ' + b'{"b": ' * depth + leaf + b"}" * depth + b"}")


@pytest.mark.parametrize("count", [WALK_VALUES - 1, WALK_VALUES + 1])
def test_bodies_of_many_values_parse_as_before(count: int) -> None:
    ids = [1] * count
    _agrees(json.dumps({"prompt": ids}).encode())
    _agrees(json.dumps({"prompt": [*ids, 2**64]}).encode())
    _agrees(json.dumps({"prompt": ids, "x": "1234567890123456789012"}).encode())


def test_a_long_integer_is_still_refused_after_orjson_parsed_it() -> None:
    """orjson reads 2**64 as a float and 2**63 as an int: both are the 400 they were."""
    for literal in (b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809"):
        with pytest.raises(APIError, match="integer out of range") as e:
            parse_json_object(b'{"seed": ' + literal + b"}")
        assert e.value.param == "seed"
    assert parse_json_object(b'{"seed": 9223372036854775807}') == {"seed": 2**63 - 1}
    assert parse_json_object(b'{"t": 1e19}') == {"t": 1e19}  # a float literal stays one


def test_a_short_body_takes_the_byte_check_and_a_long_one_the_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(body, "WALK_FROM_BYTES", 512)
    walked: list[int] = []
    real = body._numbers_exact
    monkeypatch.setattr(body, "_numbers_exact", lambda data: walked.append(1) or real(data))
    short = b'{"prompt": "hello", "max_tokens": 4}'
    long = b'{"prompt": "' + b"x" * 512 + b'", "max_tokens": 4}'
    assert parse_json_object(short) == {"prompt": "hello", "max_tokens": 4} and not walked
    assert parse_json_object(long)["max_tokens"] == 4 and walked == [1]
