"""A request's passage through the fleet queue (router/queue/fleet_queue.py): its
`Ticket` (who, which class, where it sits, what the queue predicted for it) and its
`Seat` (an `async with` for a holder of a ticket: admitted on entry, the seat freed on
exit). The proxy tells the ticket itself which worker it picked (`Ticket.sit`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from router.queue.tenants import Tenant
from shared.wire.service_class import CLASSES, ServiceClass

if TYPE_CHECKING:
    from router.holdings.prediction import RouteRequest


class TicketTally(Protocol):
    """Where a request's figures go: its tenant and class's (router/queue/stats.py
    `ClassTally`), looked up once when its ticket is made. The queue bumps the counts of
    a request seated at once and of one served in place (no call: every request)."""

    served: int
    slo_met: int
    failed: int
    waits: list[int]

    def seated(self, waited_s: float) -> None: ...

    def ended(self, good: bool, slo_met: bool) -> None: ...


class Ticket:
    """One request through the queue: who, which class, and where it sits. What only a
    waiting request needs (its arrival number, rank, urgency, predictions, future) is set
    by `wait`: a request that passes at once (the common case) never builds it."""

    __slots__ = (
        "_keeper", "arrived", "best", "best_units", "critical_at", "deadline", "exclude",
        "first_byte", "future", "klass", "model", "rank", "request", "seated", "seq", "status",
        "tally", "tenant", "units", "units_at", "urgent_at", "worker",
    )  # fmt: skip

    def __init__(
        self, tenant: Tenant, klass: ServiceClass, request: RouteRequest, model: str | None,
        now: float, slo_s: float, tally: TicketTally, keeper: SeatKeeper,
    ) -> None:  # fmt: skip
        self.tenant, self.klass, self.request, self.model = tenant, klass, request, model
        self.arrived, self.deadline = now, now + slo_s
        self.tally = tally
        self._keeper = keeper  # the queue it is in: where `sit` tells the seat moved
        self.worker: str | None = None  # the seat held, once given
        self.exclude: Collection[str] = ()  # workers the first try may not use
        self.seated: float | None = None
        self.first_byte: float | None = None
        self.status = 0

    def sit(self, worker_id: str) -> None:
        """The proxy picked `worker_id` for a try (the proxy's `Seating`, with `exclude`:
        the handler hands the ticket itself over, no `Seat` object a request)."""
        keeper = self._keeper
        if self.worker is not None:  # seated by the queue, or a retry: the queue's `sit`
            keeper.sit(self, worker_id)
            return
        # A first seat (every request that passed at once): the queue's `sit` and
        # `InPrefill.add` written here, two calls less a request.
        keeper.seats.take(worker_id)
        self.worker = worker_id
        on, key = keeper.prefilling.on, (worker_id, self.tenant)
        if key in on:
            on[key].append(self)
        else:
            on[key] = [self]

    def wait(self, slo_s: float, urgent_fraction: float, seq: int) -> None:
        """It waits in its tenant's queue: the fields the queue's rule reads (`seq`: its
        place in arrival order among the requests that waited)."""
        now = self.arrived
        self.seq = seq
        self.rank = CLASSES.index(self.klass)
        self.urgent_at = now + slo_s * urgent_fraction
        # Halfway from urgent to the deadline: held for no worker (fleet_queue.py's rule).
        self.critical_at = now + slo_s * (1 + urgent_fraction) / 2
        self.units: Mapping[str, float] = {}  # predicted cached prefix per worker
        self.units_at = now
        self.best, self.best_units = "", 0.0
        self.future: asyncio.Future[str] | None = None


class InPrefill:
    """Seated tickets whose answer has not begun, per worker and tenant: their prompt is
    not yet in the worker's cache (fleet_queue.py's rule, 0b)."""

    # A waiting turn is compared with at most this many of its tenant's tickets on the
    # worker, the latest first (a non-streamed answer stays "before its first byte" until
    # it ends: the list can be as long as the worker's seats).
    SCAN = 8

    def __init__(self) -> None:
        # (read by `Ticket.sit` and `FleetQueue.served` too: every request adds and removes)
        self.on: dict[tuple[str, Tenant], list[Ticket]] = {}

    def add(self, ticket: Ticket, worker_id: str) -> None:
        key = (worker_id, ticket.tenant)
        on = self.on
        # (`in`, not `get` or `setdefault`: no call, no list built when one is kept)
        if key in on:
            on[key].append(ticket)
        else:
            on[key] = [ticket]

    def remove(self, ticket: Ticket) -> None:
        """`ticket`'s prompt is in its worker's cache now, or never will be."""
        key = (ticket.worker, ticket.tenant)
        try:
            on = self.on[key]  # type: ignore[index]
        except KeyError:  # (rare: a ticket not seated, or left already)
            return
        if on[-1] is ticket:  # the one added last (alone on its worker: the common case)
            del on[-1]
        else:
            try:
                on.remove(ticket)  # (one scan, not `in` and then `remove`)
            except ValueError:
                return
        if not on:
            del self.on[key]  # type: ignore[arg-type]

    def of(self, worker_id: str, tenant: Tenant) -> list[Ticket] | None:
        return self.on.get((worker_id, tenant))

    @classmethod
    def extends(cls, ticket: Ticket, on: list[Ticket]) -> bool:
        """Whether `ticket`'s prompt extends one of `on` (`of`'s list; the next turn of a
        conversation whose last turn is still in prefill there)."""
        text = ticket.request.text
        return any(
            len(p.request.text) < len(text) and text.startswith(p.request.text)
            for p in itertools.islice(reversed(on), cls.SCAN)
        )


class SeatTaker(Protocol):
    """What a first seat takes (router/queue/seats.py `Seats`)."""

    def take(self, worker_id: str) -> None: ...


class SeatKeeper(Protocol):
    """What a seat asks of the queue (`FleetQueue`)."""

    seats: SeatTaker
    prefilling: InPrefill

    async def admit(self, ticket: Ticket) -> None: ...

    def sit(self, ticket: Ticket, worker_id: str) -> None: ...

    def done(self, ticket: Ticket) -> None: ...


class Seat:
    """A plain async context manager (no generator frame on the hot path); the proxy's
    `Seating` (router/upstream/proxy.py)."""

    __slots__ = ("_queue", "ticket")

    def __init__(self, queue: SeatKeeper, ticket: Ticket) -> None:
        self._queue, self.ticket = queue, ticket

    @property
    def exclude(self) -> Collection[str]:
        return self.ticket.exclude

    def sit(self, worker_id: str) -> None:
        self._queue.sit(self.ticket, worker_id)

    async def __aenter__(self) -> Seat:
        await self._queue.admit(self.ticket)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queue.done(self.ticket)
