"""The cached-tokens readers that feed the predicted-vs-actual metric without parsing
whole bodies on the hot path: they must agree with a full JSON parse."""

import json

from hypothesis import given
from hypothesis import strategies as st

from router.upstream.answers import cached_tokens_from_json, cached_tokens_from_sse


def completion(text: str, cached: int | None) -> bytes:
    usage: dict = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": text}], "usage": usage}
    return json.dumps(body).encode()


@given(text=st.text(), cached=st.one_of(st.none(), st.integers(0, 10**9)))
def test_json_reader_agrees_with_a_full_parse(text: str, cached: int | None) -> None:
    # Output text can contain anything, including the key itself: it is escaped in JSON.
    assert cached_tokens_from_json(completion(text + '"cached_tokens": 7', cached)) == cached


def test_json_reader_without_usage() -> None:
    assert cached_tokens_from_json(b'{"error": {"message": "x"}}') is None
    assert cached_tokens_from_json(b"") is None


def test_sse_reader_takes_the_final_usage_chunk() -> None:
    chunk = {"choices": [{"delta": {"content": '"cached_tokens": 3'}}]}
    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 42}}}
    tail = (f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n").encode()
    assert cached_tokens_from_sse(tail) == 42
    assert cached_tokens_from_sse(f"data: {json.dumps(chunk)}\n\n".encode()) is None
    assert cached_tokens_from_sse(b"data: [DONE]\n\n") is None
