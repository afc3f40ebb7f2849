"""One OpenAI response, streamed (SSE) or whole, read into what a load-test record needs:
time to the first generated text, the mean gap between later chunks, the text, and the
usage (prompt, cached and output tokens). Parsed as bytes arrive (loadtests/load/sse.py).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from loadtests.load.sse import SSEParser


@dataclass
class Result:
    end: float = 0.0
    first: float | None = None
    itl: float | None = None
    itls: list[float] = field(default_factory=list)  # every gap between chunks
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def error_text(resp: Any) -> str:
    try:
        return str(resp.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return (resp.text or "")[:300]


def add_usage(result: Result, usage: dict[str, Any]) -> None:
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0)


def piece_of(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def read_stream(resp: Any, start: float) -> Result:
    result, parser, pieces, times = Result(), SSEParser(), [], []
    for chunk in resp.iter_content(chunk_size=None):  # None: hand over bytes as they arrive
        now = time.perf_counter()
        for data in parser.feed(chunk):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = f"stream error: {event['error'].get('message', event['error'])}"
                continue
            for choice in event.get("choices") or []:
                piece = piece_of(choice)
                if piece:
                    pieces.append(piece)
                    times.append(now)
            if event.get("usage"):
                add_usage(result, event["usage"])
    result.end = time.perf_counter()
    result.text = "".join(pieces)
    result.first = times[0] if times else None
    if len(times) > 1:
        result.itl = (times[-1] - times[0]) / (len(times) - 1)
        result.itls = [b - a for a, b in itertools.pairwise(times)]
    if not result.output_tokens:
        result.output_tokens = len(times)
    return result


def read_whole(resp: Any, start: float) -> Result:
    body = resp.json()
    choice = body["choices"][0]
    result = Result(end=time.perf_counter())
    result.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    add_usage(result, body.get("usage") or {})
    return result
