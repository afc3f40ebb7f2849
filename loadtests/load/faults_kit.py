"""What every fault scenario shares (loadtests/load/faults.py, faults_clients.py, faults_up.py):
the options, a result row, the steady load around a fault, and polling for recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from loadtests.load.cluster import BenchFleet, WorkerSpec
from loadtests.load.traffic import Outcome, SteadyLoad, call, prompt, session

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
    fleet: BenchFleet, o: Options, fault: Callable[[], Awaitable[tuple[float, str]]],
    body: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[list[Outcome], float, str]:  # fmt: skip
    """Steady load plus 4 long streams, the fault in the middle, then `after_s` more."""
    assert fleet.router is not None
    return await load_around(fleet.router.url, o, fault, body)


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


def row(name: str, fleet: BenchFleet, outcomes: list[Outcome], recover_s: float, note: str) -> Row:
    retried = fleet.router_metric("radix_router_retries_total")
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
