"""AdmissionGate control: at most `max_concurrent` requests proxied at once, a bounded queue.

A request that finds the queue full, or waits longer than `queue_timeout`, is refused
with 429 and a `Retry-After` header rather than piling up unbounded memory and latency.
While draining, new requests are refused with 503 so a load balancer moves on.
"""

from __future__ import annotations

import asyncio
import math

from shared.serving.errors import APIError


class AdmissionGate:
    def __init__(self, max_concurrent: int, max_queue: int, queue_timeout: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self._slots = asyncio.Semaphore(max_concurrent)
        self.active = 0
        self.waiting = 0
        self.draining = False
        # SIGTERM seen: readiness answers 503 while requests are still served
        # (`shutdown_delay`), then `drain` refuses new ones.
        self.stopping = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.queue_timeout / 4)))

    def _refuse(self, why: str) -> APIError:
        return APIError(
            429, f"the router is at capacity ({why}); retry later",
            code="too_many_requests", headers={"Retry-After": self.retry_after},
        )  # fmt: skip

    def slot(self) -> _Slot:
        """`async with admission.slot():` holds one of `max_concurrent` places."""
        return _Slot(self)

    async def _enter(self) -> None:
        if self.draining:
            raise APIError(
                503, "the router is shutting down", code="draining", headers={"Retry-After": "1"}
            )
        if self._slots.locked():
            if self.waiting >= self.max_queue:
                raise self._refuse("queue full")
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
            except TimeoutError:
                raise self._refuse("queue timeout") from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.active += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.active -= 1
        self._slots.release()
        if self.active == 0 and self.waiting == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait for those admitted; True if all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class _Slot:
    """A plain async context manager: a generator-based one (`@asynccontextmanager`) costs
    a generator, its frame and two extra sends on every request of the hot path."""

    __slots__ = ("_admission",)

    def __init__(self, admission: AdmissionGate) -> None:
        self._admission = admission

    async def __aenter__(self) -> None:
        await self._admission._enter()

    async def __aexit__(self, *exc: object) -> None:
        self._admission._exit()
