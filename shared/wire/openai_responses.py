"""OpenAI response bodies and stream chunks, built in one place.

Every `usage` carries `prompt_tokens_details.cached_tokens`, also when 0, so clients
and the router can always read how much of the prompt the KV cache served.
"""

from __future__ import annotations

import uuid
from typing import Any

WireFinishReason = str | None  # what OpenAI clients read; the engine has its own FinishReason


def new_request_id(prefix: str) -> str:
    """`chatcmpl-…`, `cmpl-…`: the ids OpenAI clients expect."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _finish(reason: WireFinishReason) -> WireFinishReason:
    # "abort" is the engine's word; OpenAI clients only know stop/length/... .
    return "stop" if reason == "abort" else reason


def _envelope(
    obj: str,
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields every body and chunk share; `usage` only on bodies and the usage chunk."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def choice(
    index: int, content: dict[str, Any], finish_reason: WireFinishReason, logprobs: Any = None
) -> dict[str, Any]:
    """One choice: `content` is its text, message or delta field."""
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": _finish(finish_reason),
    }


def envelope(
    obj: str, rid: str, model: str, created: int, choices: list[dict[str, Any]],
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A body (with `use`) or chunk of any number of choices."""
    return _envelope(obj, rid, model, created, choices, use)


def usage_chunk(
    obj: str, rid: str, model: str, created: int, use: dict[str, Any]
) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, only usage."""
    return _envelope(obj, rid, model, created, [], use)
