"""A stored event's ids checked and packed to key text (shared/wire/kv_decode.py
`_check_ids`, a packer made once per count of ids) answer as the rule it replaced: main
2b35cc5's `struct.pack` with a format built every call, kept here as the oracle. Both
decoders (typed and checked) call `_check_ids`, so their differential
(test_kv_events_typed.py) cannot see it: this one can."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.wire import kv_decode
from shared.wire.kv_decode import _check_ids


def old_check_ids(tokens: list[object]) -> str:
    """`_check_ids` as main 2b35cc5 had it."""
    try:
        packed = struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error:
        raise ValueError("token ids are not integers in range") from None
    if not packed[3::4].isascii():
        raise ValueError("token id out of range")
    return packed.decode("latin-1")


def outcome(check: object, tokens: list[object]) -> tuple[str, str | None]:
    try:
        return "ok", check(tokens)  # type: ignore[operator]
    except ValueError:
        return "refused", None


ids = st.one_of(
    st.integers(0, 2**31 - 1),
    st.integers(0, 300),
    st.sampled_from([-1, -(2**31), 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**64, -(2**63)]),
    st.booleans(),  # (ints to struct, as msgpack's checked decoder hands them over)
    st.floats(allow_nan=False, width=32),
    st.none(),
)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=80) | st.lists(ids, max_size=80))
def test_ids_answer_as_the_old_rule(tokens: list[object]) -> None:
    assert outcome(_check_ids, tokens) == outcome(old_check_ids, tokens)


def test_the_packers_kept_are_bounded_and_any_count_still_packs() -> None:
    for n in range(3 * kv_decode._PACKERS_MAX):  # counts past the bound: it starts again
        tokens = list(range(n))
        assert _check_ids(tokens) == old_check_ids(tokens)
        assert len(kv_decode._PACKERS) <= kv_decode._PACKERS_MAX
    assert _check_ids([5] * 32) == old_check_ids([5] * 32)
