"""Which workers echo `x-request-id`, and what a worker that does not costs.

A connection to a worker is reused only after an answer that echoed the request's id
(router/upstream/connection.py says why silence proves nothing). A worker that does not
echo, a stock engine started without its switch, therefore gets a new connection per
request: ~1.4x the router's CPU per request and about half its throughput
(`python -m loadtests upstream-reuse`, loadtests/results/router_cpu.md). The book below
says which workers those are, so `/workers`, `/metrics` and the dashboard can name them
and the flag that fixes it (`radix-worker attach` turns it on where the engine has one).

Kept per worker URL, at most `MAX_WORKERS` of them (the oldest dropped first): a worker
that leaves takes nothing with it on the hot path, and a churning fleet cannot grow it.
"""

from __future__ import annotations

MAX_WORKERS = 4096
NO_ECHO_COST = (
    "answers do not echo x-request-id: a new upstream connection per request, about 1.4x "
    "the router's CPU per request (vLLM: --enable-request-id-headers; see the README's "
    "attach section)"
)


class EchoStatus:
    """One worker's answers so far: how many, and how many did not echo (each of those
    cost a fresh connection for the next request)."""

    __slots__ = ("answers", "echoed_last", "unechoed")

    def __init__(self) -> None:
        self.answers = 0
        self.unechoed = 0
        self.echoed_last = True

    def record(self, echoed: bool) -> None:
        self.answers += 1
        self.echoed_last = echoed
        if not echoed:
            self.unechoed += 1

    def describe(self) -> dict[str, object]:
        """What `/workers` and the dashboard show (`echoes`: None before any answer)."""
        echoes = None if self.answers == 0 else self.echoed_last
        return {
            "echoes": echoes,
            "answers_total": self.answers,
            "unechoed_answers_total": self.unechoed,
            "cost": NO_ECHO_COST if echoes is False else None,
        }


class EchoBook:
    """Per worker base URL, its `EchoStatus` (created on first use)."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._by_url: dict[str, EchoStatus] = {}

    def of(self, base_url: str) -> EchoStatus:
        found = self._by_url.get(base_url)
        if found is None:
            if len(self._by_url) >= self.max_workers:
                del self._by_url[next(iter(self._by_url))]  # the oldest
            found = self._by_url[base_url] = EchoStatus()
        return found

    def get(self, base_url: str) -> EchoStatus | None:
        """The worker's status, None when no request went to it yet."""
        return self._by_url.get(base_url)
