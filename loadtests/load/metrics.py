"""Per-request records of an LLM load test and the aggregates shown with the results.

Each finished request becomes one `RequestRecord` (one JSON line in the records file);
the summary, the plots and the cache hit rate are all computed from those lines, so a
run can be re-reported later and a simulator can write the same format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path


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
