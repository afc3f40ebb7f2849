"""Client traffic against a cluster (loadtests/load/cluster.py), for fault tests and `faults`.

One request, a stream, or a steady load at fixed concurrency, each outcome recorded
(status, worker, SSE events). A request that cannot connect, or whose stream does not
close within its timeout, is an outcome too (status 0 with the reason), never an
exception, so a test can assert "nothing lost, nothing hung" over all of them.

Below, what every `faults` scenario shares (loadtests/load/faults.py, faults_clients.py):
the options, a result row, the steady load around a fault, and polling for recovery.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.load.cluster import Cluster, WorkerSpec

HUNG = "hung"  # the reason recorded when a response did not end within its timeout


@dataclass
class Outcome:
    status: int  # 0: no HTTP answer (connection refused/reset, or hung)
    worker: str | None = None  # x-radix-worker: the worker that answered
    events: list[str] = field(default_factory=list)  # SSE `data:` payloads, streams only
    reason: str = ""
    started: float = 0.0
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        if self.status != 200:
            return False
        return not self.events or self.events[-1] == "[DONE]"

    @property
    def stream_error(self) -> dict[str, Any] | None:
        """The error event a broken stream ends with, if it ends with one."""
        if not self.events or self.events[-1] == "[DONE]":
            return None
        try:
            last = json.loads(self.events[-1])
        except ValueError:
            return None
        return last.get("error") if isinstance(last, dict) else None


def session(timeout: float = 60.0) -> aiohttp.ClientSession:
    # No connection cap: the tests mean N requests at once, not N queued in the client.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout)
    )


def prompt(i: int, tokens: int = 40, groups: int = 8) -> dict[str, Any]:
    """Prompts in `groups` shared-prefix groups, so the cache-aware policy has trees."""
    return {
        "prompt": f"group {i % groups} shared prefix " * 20 + f"request {i}",
        "max_tokens": tokens,
    }


async def call(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float = 30.0,
    headers: dict[str, str] | None = None, first_event: asyncio.Event | None = None,
) -> Outcome:  # fmt: skip
    """POST one request (streamed when body["stream"]) and read it to the end;
    `first_event` is set when the first SSE event arrives."""
    out = Outcome(0, started=time.monotonic())
    try:
        async with asyncio.timeout(timeout):
            async with http.post(url, json=body, headers=headers) as r:
                out.status, out.worker = r.status, r.headers.get("x-radix-worker")
                if r.content_type == "text/event-stream":
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            out.events.append(line[6:].decode().strip())
                            if first_event is not None:
                                first_event.set()
                else:
                    await r.read()
    except TimeoutError:
        out.reason = HUNG
    except (aiohttp.ClientError, OSError) as e:
        out.reason = f"{type(e).__name__}: {e}"
    out.ended = time.monotonic()
    return out


async def burst(
    http: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], timeout: float = 30.0
) -> list[Outcome]:
    return list(await asyncio.gather(*(call(http, url, b, timeout) for b in bodies)))


class SteadyLoad:
    """`concurrency` clients, each sending the next request as soon as one ends."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, concurrency: int,
        body: Callable[[int], dict[str, Any]] = prompt, timeout: float = 30.0,
    ) -> None:  # fmt: skip
        self.http, self.url, self.concurrency = http, url, concurrency
        self.body, self.timeout = body, timeout
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    async def _client(self) -> None:
        while not self._stop.is_set():
            self._n += 1
            self.outcomes.append(await call(self.http, self.url, self.body(self._n), self.timeout))

    def start(self) -> SteadyLoad:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.concurrency)]
        return self

    async def stop(self) -> list[Outcome]:
        """Let every request in flight finish (each is bounded by its timeout)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes

    async def until_count(self, n: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while len(self.outcomes) < n:
                await asyncio.sleep(0.02)


def failures(outcomes: list[Outcome]) -> list[str]:
    """A readable line per failed outcome (for assertion messages)."""
    return [
        f"status={o.status} worker={o.worker} reason={o.reason} last={o.events[-1:]}"
        for o in outcomes
        if not o.ok
    ]


SPEC = WorkerSpec(decode_ms=3.0, heartbeat_s=0.5, max_running=64)
ADMIN_KEY = "faults-admin"


@dataclass(frozen=True)
class Options:
    workers: int
    concurrency: int
    before_s: float
    after_s: float
    redis_outage_s: float
    tokens: int
    slow_clients: int = 16


@dataclass
class Row:
    scenario: str
    sent: int
    ok: int
    retried: float
    recover_s: float
    note: str = ""

    def line(self) -> str:
        failed = self.sent - self.ok
        return (f"| {self.scenario} | {self.sent} | {self.ok} | {failed} | {self.retried:.0f} | "
                f"{self.recover_s:.2f} | {self.note} |")  # fmt: skip


async def poll(check: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not await asyncio.to_thread(check):
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not recovered within {timeout}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def with_load(
    cluster: Cluster, o: Options, fault: Callable[[], Awaitable[tuple[float, str]]],
    body: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[list[Outcome], float, str]:  # fmt: skip
    """Steady load plus 4 long streams, the fault in the middle, then `after_s` more."""
    assert cluster.router is not None
    return await load_around(cluster.router.url, o, fault, body)


async def load_around(
    router_url: str, o: Options, fault: Callable[[], Awaitable[tuple[float, str]]],
    body: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[list[Outcome], float, str]:  # fmt: skip
    """`with_load` against any router URL (a fleet `radix-router up` started, too)."""
    url = router_url + "/v1/completions"
    async with session(timeout=120) as http:
        load = SteadyLoad(http, url, o.concurrency, body or (lambda i: prompt(i, o.tokens)))
        load.start()
        streams = [
            # ≈8 s of decode: still streaming when the fault comes at `before_s`.
            asyncio.create_task(call(http, url, {**prompt(i, 2500), "stream": True}, timeout=110))
            for i in range(4)
        ]
        try:
            await asyncio.sleep(o.before_s)
            recover_s, note = await fault()
            await asyncio.sleep(o.after_s)
        finally:  # every request ends (each is bounded) before the session closes
            outcomes = await load.stop() + list(await asyncio.gather(*streams))
    return outcomes, recover_s, note


def row(name: str, cluster: Cluster, outcomes: list[Outcome], recover_s: float, note: str) -> Row:
    retried = cluster.router_metric("radix_router_retries_total")
    return Row(
        name,
        len(outcomes),
        sum(x.ok for x in outcomes),
        retried,
        recover_s,
        note + cut_note(outcomes),
    )


def cut_note(outcomes: list[Outcome]) -> str:
    """What the failures were: cut streams (with their error event) and other answers."""
    cut = [x.stream_error["message"] for x in outcomes if x.stream_error is not None]
    other = sorted(
        {f"{x.status} {x.reason}".strip() for x in outcomes if not x.ok and x.stream_error is None}
    )
    note = f"; {len(cut)} streams cut with an error event ({cut[0]})" if cut else ""
    return note + (f"; other failures: {', '.join(other)}" if other else "")
