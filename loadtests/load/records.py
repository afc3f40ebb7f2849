"""Per-request records of an LLM load test, and how one response becomes one.

Each finished request becomes one `RequestRecord` (one JSON line in the records file);
the summary, the plots and the cache hit rate are all computed from those lines, so a
run can be re-reported later and a simulator can write the same format.

One OpenAI response, streamed (SSE) or whole, is read into what a record needs (`Result`):
time to the first generated text, the mean gap between later chunks, the text, and the
usage (prompt, cached and output tokens). Server-sent events are parsed as bytes arrive
(`SSEParser`): an event split across network chunks anywhere (even inside a UTF-8
character or between `\\r` and `\\n`), several events in one chunk, multi-line data.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    start: float  # wall-clock (epoch) seconds when the request was sent
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between streamed chunks after the first
    itls_s: list[float] = field(default_factory=list)  # every gap between streamed chunks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str = "direct"  # x-radix-worker header from the router; "direct" without one
    tag: str = ""
    error: str = ""
    # Open-loop runs (a request rate): when the request was due, epoch seconds. A send
    # later than that means every user was busy (the client's concurrency cap).
    due: float | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["itls_s"] = [round(g, 6) for g in self.itls_s]  # µs: enough, and half the bytes
        return json.dumps(d, separators=(",", ":"))


def read_records(path: str | Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord(**json.loads(line)) for line in f if line.strip()]


@dataclass
class HitCounter:
    """cached_tokens / prompt_tokens, overall and per worker."""

    prompt: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)

    def add(self, worker: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt[worker] = self.prompt.get(worker, 0) + prompt_tokens
        self.cached[worker] = self.cached.get(worker, 0) + cached_tokens
        self.requests[worker] = self.requests.get(worker, 0) + 1

    def merge(self, other: dict[str, dict[str, int]]) -> None:
        """Add counts reported by another locust process (`as_dict` output)."""
        for w, n in other.get("prompt", {}).items():
            self.prompt[w] = self.prompt.get(w, 0) + n
        for w, n in other.get("cached", {}).items():
            self.cached[w] = self.cached.get(w, 0) + n
        for w, n in other.get("requests", {}).items():
            self.requests[w] = self.requests.get(w, 0) + n

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "prompt": dict(self.prompt),
            "cached": dict(self.cached),
            "requests": dict(self.requests),
        }

    @property
    def hit_rate(self) -> float:
        total = sum(self.prompt.values())
        return sum(self.cached.values()) / total if total else 0.0

    def worker_hit_rate(self, worker: str) -> float:
        p = self.prompt.get(worker, 0)
        return self.cached.get(worker, 0) / p if p else 0.0

    def table(self) -> str:
        lines = [
            f"{'worker':<24} {'requests':>9} {'prompt tok':>11} {'cached tok':>11} {'hit rate':>9}"
        ]
        for w in sorted(self.prompt):
            lines.append(
                f"{w:<24} {self.requests.get(w, 0):>9} {self.prompt[w]:>11} "
                f"{self.cached.get(w, 0):>11} {self.worker_hit_rate(w):>9.3f}"
            )
        lines.append(
            f"{'all':<24} {sum(self.requests.values()):>9} {sum(self.prompt.values()):>11} "
            f"{sum(self.cached.values()):>11} {self.hit_rate:>9.3f}"
        )
        return "\n".join(lines)

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord]) -> HitCounter:
        hc = cls()
        for r in records:
            if r.ok:
                hc.add(r.worker, r.prompt_tokens, r.cached_tokens)
        return hc


# -- reading a response ---------------------------------------------------------------
# A lone trailing CR may be the first half of CRLF: it ends a line only once more follows.
_EOL = re.compile(r"\r\n|\n|\r(?=[\s\S])")


class SSEParser:
    """Feed bytes as they arrive, get the `data:` payloads of the events they complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Return the data of every event completed by this chunk, in order."""
        buf = self._buf + self._decoder.decode(chunk)
        out: list[str] = []
        pos = 0
        while (m := _EOL.search(buf, pos)) is not None:
            line = buf[pos : m.start()]
            pos = m.end()
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # Comments (":"), event:, id: and retry: carry nothing a client needs here.
        self._buf = buf[pos:]
        return out


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
