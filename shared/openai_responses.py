"""OpenAI response bodies and stream chunks, built in one place.

Every `usage` carries `prompt_tokens_details.cached_tokens`, also when 0, so clients
and the router can always read how much of the prompt the KV cache served.
"""

from __future__ import annotations

import uuid
from typing import Any

FinishReason = str | None


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


def _finish(reason: FinishReason) -> FinishReason:
    # "abort" is the engine's word; OpenAI clients only know stop/length/... .
    return "stop" if reason == "abort" else reason


def completion_body(
    rid: str, model: str, created: int, text: str, finish_reason: FinishReason, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(finish_reason)}
        ],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish_reason: FinishReason
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(finish_reason)}
        ],
    }


def chat_body(
    rid: str, model: str, created: int, text: str, finish_reason: FinishReason, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": _finish(finish_reason),
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: FinishReason
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(finish_reason)}
        ],
    }


def usage_chunk(
    obj: str, rid: str, model: str, created: int, use: dict[str, Any]
) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, only usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }
