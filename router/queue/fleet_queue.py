"""The fleet queue: the policy decides where a request goes, this decides when.

Arrival. While nothing waits and some worker of the request's model has a free seat
(router/queue/seats.py), the request passes at once: the policy picks among the
workers with a free seat and the seat is taken on the one it picks. Otherwise it
waits in the router, in its tenant's FIFO for its class (router/queue/tenants.py). A
tenant past its `max_queue` waiting requests, or a request that waited its tenant's
`max_queue_wait_s`, is answered 429 with Retry-After and a message naming the bound;
no other tenant is refused for it. Load is never a 503; draining is.

The rule: a freed seat on worker w goes to the best waiting request w can serve,
looking at the first `SCAN` requests of each tenant's FIFO per class, in this order:
  0. locality, in two parts:
     a. a request whose best worker (most predicted cached prefix) is not w, has more
        predicted there than on w, and has a free seat in this same pass is not w's:
        it takes its best worker's seat instead (urgent or not: a free seat where it
        hits costs no wait);
     b. a request is held, until critical (step 3), for its best worker when that one
        holds over twice w's prediction, and away from w while the turn it extends (a
        request of its tenant whose prompt is a prefix of its own) is still before its
        first byte on w: sent now, it would find that prompt not yet in w's cache. A
        held one takes w's seat only when no one else can use it, so a seat never stays
        empty for it;
  1. class: interactive, then standard, then batch (strict bands, as llm-d's flow
     control and Dynamo's router have them);
  2. fair share within the class (deficit round robin): tenants with credit first; a
     seat costs one request of credit. When no waiting tenant w can serve has credit,
     each gets weight x `queue_quantum`; a tenant that starts waiting starts with that
     much, one that stops waiting keeps none. A tenant without credit still takes a
     seat no one with credit can use: a seat never stays empty for fairness. Between
     tenants with work waiting in a class, service follows their weights to within a
     quantum, which is also how far locality may run ahead of fairness (DLPM's bound);
  3. urgency: a request that waited `queue_urgent_fraction` (f) of its class's TTFT
     objective goes first, the earliest deadline first, still on its best worker
     (0b holds it from the others: that one frees a seat soon, and a seat away costs
     its whole cached prefix). Once critical, halfway from there to its deadline
     (waited (1 + f) / 2 of the objective), it is held for no worker: it would miss its
     deadline waiting for its best one;
  4. the longest predicted cached prefix on w (affinity);
  5. arrival order.
Urgency never lifts a request over a higher class (a flood of standard requests past
their objective must not hold back interactive ones), and no class is fair-shared
against another: a tenant's interactive request goes before another's batch one.

Affinity is what the router predicts each worker holds of the request's prompt
(`Affinity`: the holdings room's tree, router/holdings/room.py `affinity`), asked
when the request starts waiting (one that passes at once costs nothing) and again when
a seat looks at it `REFRESH_S` later, at most `REFRESH_BUDGET` times a pass: the
tree learns where the turn before it went once that turn leaves the queue. Each
placement of a waiting request is counted as on its best worker or away from it
(`QueueStats.placed`): what locality the queue gave up, and why.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from router.queue.seats import WINDOW_INTERVALS, Seats
from router.queue.stats import QueueStats
from router.queue.tenants import Tenant, Tenants
from router.queue.ticket import InPrefill, Seat, Ticket
from shared.config import MAX_QUANTUM, MAX_WEIGHT, MIN_QUANTUM, MIN_WEIGHT, RouterConfig
from shared.serving.errors import APIError
from shared.wire.service_class import CLASSES, ServiceClass

if TYPE_CHECKING:
    from router.fleet.view import FleetView
    from router.fleet.workers import Worker
    from router.holdings.prediction import RouteRequest

# Per class FIFO, how many of its oldest requests a freed seat looks at: enough for
# affinity to find a hit, bounded so a queue of thousands costs nothing per seat.
SCAN = 16
# Seats are re-read this often: another replica's requests end, heartbeats change a
# worker's seats, workers join (a local request's end re-reads its worker at once).
TICK_S = 0.05
# A waiting request's affinity is asked again once this old, at most this many a pass
# (a tree walk is ~10 µs on an 8,000-char prompt, loadtests/results/tree.md).
REFRESH_S = 0.1
REFRESH_BUDGET = 32
Affinity = Callable[["RouteRequest"], Mapping[str, float]]
# Defensive bounds on the credit arithmetic, beyond the config's (shared/config.py
# bounds weight and queue_quantum to finite credit, the wait to MAX_QUEUE_WAIT_S): a
# widened config must not make `_best_for` raise on every freed seat or `_refuse` a 500.
MIN_ROUND_CREDIT, MAX_ROUND_CREDIT = MIN_WEIGHT * MIN_QUANTUM, MAX_WEIGHT * MAX_QUANTUM
MAX_ROUNDS = 2**53
MAX_RETRY_AFTER_S = 86_400


class FleetReads(Protocol):
    """What the queue reads of the worker table (router/fleet/table.py `Fleet`)."""

    @property
    def workers(self) -> Mapping[str, Worker]: ...

    def view(
        self, now: float, model: str | None = None, exclude: Iterable[str] = ()
    ) -> FleetView: ...


class FleetQueue:
    def __init__(
        self,
        config: RouterConfig,
        fleet: FleetReads,
        affinity: Affinity,
        remote: Callable[[], Mapping[str, int]] | None,
        clock: Callable[[], float],
        stats_registry: object = None,
    ) -> None:
        self.config, self.fleet, self.affinity, self.clock = config, fleet, affinity, clock
        self.tenants = Tenants(config)
        window = math.ceil(WINDOW_INTERVALS * config.sync_load_interval / TICK_S)
        self.seats = Seats(
            fleet.workers, remote, config.queue_spare_seats, config.max_concurrent,
            config.queue_replica_slack, window,
        )  # fmt: skip
        self.stats = QueueStats(self.tenants, stats_registry)  # type: ignore[arg-type]
        self._tallies = self.stats.tallies  # where a ticket's figures go, by (tenant, class)
        self._slo = {c: getattr(config.classes, c).ttft_slo_s for c in CLASSES}
        self._seq = itertools.count()
        self._refreshes = 0  # affinity asks left in this pass
        self.prefilling = InPrefill()  # a turn that extends one waits for it (0b)
        self.waiting = 0
        # Admitted: passing or seated (from the moment a seat is given, before the waiter
        # wakes), until their answer ends.
        self.active = 0
        self.draining = False
        # SIGTERM seen: readiness answers 503 while requests are still served
        # (`shutdown_delay`), then `drain` refuses new ones.
        self.stopping = False
        # What `drain` waits on, made when it starts: until then no request pays for an
        # idle event (an `asyncio.Event`'s clear and set were two calls a request).
        self._drained: asyncio.Future[None] | None = None

    # -- arrival ------------------------------------------------------------------------
    def ticket(self, tenant: Tenant, klass: ServiceClass, request: RouteRequest) -> Ticket:
        return Ticket(
            tenant, klass, request, request.model or None, self.clock(), self._slo[klass],
            self._tallies[tenant.name, klass], self,
        )  # fmt: skip

    def arrive(self, tenant: Tenant, klass: ServiceClass, request: RouteRequest) -> Ticket:
        """`ticket` and `pass_now` in one call (the handler's, every request): the ticket
        is seated (`seated` set) when it passes at once, else it must `wait_turn`."""
        ticket = Ticket(
            tenant, klass, request, request.model or None, self.clock(), self._slo[klass],
            self._tallies[tenant.name, klass], self,
        )  # fmt: skip
        if self.draining:
            raise _draining()
        seats = self.seats
        if (
            not self.waiting
            and seats.total < seats.max_concurrent
            and (not seats.full or self._pass_saturated(ticket))
        ):
            ticket.seated = ticket.arrived
            self.active += 1
            ticket.tally.waits[0] += 1  # seated on arrival: no wait to add
        return ticket

    async def admit(self, ticket: Ticket) -> None:
        """Return once `ticket` may go (its `exclude` set); raise 503 draining or 429."""
        if not self.pass_now(ticket):
            await self.wait_turn(ticket)

    def pass_now(self, ticket: Ticket) -> bool:
        """Admit `ticket` at once when nothing waits and a seat is free (True; the
        handler's common case, no coroutine); False: it must `wait_turn`. Raises 503
        while draining."""
        if self.draining:
            raise _draining()
        seats = self.seats
        if self.waiting or seats.total >= seats.max_concurrent:
            return False
        # Below saturation `full` is empty: the first try may use any worker, no pass
        # over the fleet.
        if seats.full and not self._pass_saturated(ticket):
            return False
        ticket.seated = ticket.arrived
        self.active += 1
        ticket.tally.waits[0] += 1  # seated on arrival: no wait to add
        return True

    async def wait_turn(self, ticket: Ticket) -> None:
        """Wait in the tenant's queue for a seat (after `pass_now` said no); 429 past the
        tenant's bounds."""
        tenant = ticket.tenant
        if tenant.waiting >= tenant.max_queue:
            self.stats.refused(tenant.name, ticket.klass)
            raise self._refuse(
                tenant, f"its max_queue bound ({tenant.max_queue} requests waiting)", "queue_full"
            )
        await self._wait(ticket)
        ticket.tally.seated(ticket.seated - ticket.arrived)  # type: ignore[operator]

    def _pass_saturated(self, ticket: Ticket) -> bool:
        """Whether `ticket` may go at once while some workers are full: one of its
        model's workers has a free seat; sets those it may not use."""
        seats = self.seats
        ids = self.fleet.view(self.clock(), ticket.model).ids
        full = [wid for wid in ids if wid in seats.full]
        if full and len(full) == len(ids):
            return False
        ticket.exclude = full
        return True

    async def _wait(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        ticket.wait(self._slo[ticket.klass], self.config.queue_urgent_fraction, next(self._seq))
        self._predict(ticket, ticket.arrived)
        ticket.future = asyncio.get_running_loop().create_future()
        if not tenant.waiting:
            tenant.credit = _round_credit(tenant.weight * self.config.queue_quantum)
        tenant.queues[ticket.rank].append(ticket)
        tenant.waiting += 1
        self.waiting += 1
        self.pump()
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), tenant.max_wait_s)
        except BaseException as e:
            if ticket.worker is not None:  # given a seat just as it gave up
                self.active -= 1
                self._release_seat(ticket)
            else:
                self._unqueue(ticket)
            # It gave up: the queue may be idle now. Not on the way in: `wait_turn`
            # admits a seated ticket at once, and a wake here (active and waiting both 0
            # for that instant) let `drain` end with the request still to be served.
            self._settle_idle()
            if isinstance(e, TimeoutError):
                self.stats.refused(tenant.name, ticket.klass)
                raise self._refuse(
                    tenant, f"its max_queue_wait_s bound ({tenant.max_wait_s:g} s)", "queue_timeout"
                ) from None
            raise

    def _predict(self, ticket: Ticket, now: float) -> None:
        ticket.units = units = self.affinity(ticket.request)
        ticket.units_at = now
        if units:
            ticket.best = max(units, key=units.__getitem__)
            ticket.best_units = units[ticket.best]
        else:
            ticket.best, ticket.best_units = "", 0.0

    def _refuse(self, tenant: Tenant, bound: str, code: str) -> APIError:
        # A quarter of the wait bound, at most a day whatever the bound (the config
        # stops at MAX_QUEUE_WAIT_S; an infinite one raised OverflowError here: a 500).
        quarter = tenant.max_wait_s / 4
        retry = max(1, math.ceil(quarter)) if quarter < MAX_RETRY_AFTER_S else MAX_RETRY_AFTER_S
        return APIError(
            429, f"tenant {tenant.name!r} is past {bound}; retry later",
            code=code, headers={"Retry-After": str(retry)},
        )  # fmt: skip

    # -- while it runs --------------------------------------------------------------------
    def sit(self, ticket: Ticket, worker_id: str) -> None:
        """The proxy picked `worker_id` for a try: the ticket's seat is there now."""
        if ticket.worker == worker_id:
            return
        if ticket.worker is not None:
            self.prefilling.remove(ticket)
            self.seats.give(ticket.worker)
        self.seats.take(worker_id)
        ticket.worker = worker_id
        self.prefilling.add(ticket, worker_id)

    def answered(self, ticket: Ticket, status: int) -> None:
        """The answer's head left (its first byte: the router's TTFT)."""
        if ticket.first_byte is None:
            ticket.first_byte, ticket.status = self.clock(), status
            self.prefilling.remove(ticket)

    def served(self, ticket: Ticket, status: int) -> None:
        """A whole answer is ready to leave (the handler's common end): `answered` then
        `done`, in one call and without their inner calls but one (prefill's `remove`,
        the tally's `ended`; every request leaves through `_leave`)."""
        first_byte = ticket.first_byte
        worker = ticket.worker
        if first_byte is None:  # (a stream's head left already: answered then)
            first_byte = ticket.first_byte = self.clock()
            ticket.status = status
            if worker is not None:  # `InPrefill.remove`'s common case: the one added last
                on, key = self.prefilling.on, (worker, ticket.tenant)
                if key in on and (kept := on[key])[-1] is ticket:  # (kept: never empty)
                    del kept[-1]
                    if not kept:
                        del on[key]
                else:
                    self.prefilling.remove(ticket)
        self.active -= 1
        tally = ticket.tally
        if ticket.status < 400:  # `ClassTally.ended`, inlined
            tally.served += 1
            tally.slo_met += first_byte <= ticket.deadline
        else:
            tally.failed += 1
        self._leave(ticket)

    def done(self, ticket: Ticket) -> None:
        """The request ended, whatever the way: its seat frees and goes on at once."""
        self.active -= 1
        first_byte = ticket.first_byte
        good = first_byte is not None and ticket.status < 400
        ticket.tally.ended(good, good and first_byte <= ticket.deadline)  # type: ignore[operator]
        if first_byte is None and ticket.worker is not None:  # (answered: out of prefill already)
            self.prefilling.remove(ticket)
        self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        """A request's end: its seat back to its worker, the next waiter seated at once,
        a drain told when the last request has left."""
        worker = ticket.worker
        if worker is not None:
            self.seats.give(worker)
            ticket.worker = None
            if self.waiting:
                self.pump()
        if self._drained is not None:
            self._settle_idle()

    def _release_seat(self, ticket: Ticket) -> None:
        if ticket.first_byte is None:  # (an answered ticket left prefill at its first byte)
            self.prefilling.remove(ticket)
        self.seats.give(ticket.worker)  # type: ignore[arg-type]
        ticket.worker = None
        self.pump()

    def _settle_idle(self) -> None:
        """Wake a `drain` once nothing is admitted or waiting."""
        drained = self._drained
        if drained is not None and not drained.done() and self.active == 0 and self.waiting == 0:
            drained.set_result(None)

    # -- the rule -----------------------------------------------------------------------
    def pump(self) -> None:
        """Give every free seat to the best waiting request for it (the module's rule)."""
        if not self.waiting:
            return
        now = self.clock()
        routable: dict[str | None, frozenset[str]] = {}
        self._refreshes = REFRESH_BUDGET
        seats = self.seats
        while self.waiting and seats.total < seats.max_concurrent:
            ids = self.fleet.view(now).ids
            free = [wid for wid in ids if seats.free(wid)]
            # The emptiest worker first, so seats freed together spread the queue.
            free.sort(key=lambda wid: seats.occupied(wid) / (seats.seats(wid) or math.inf))
            free_set = frozenset(free)
            for wid in free:
                picked = self._best_for(wid, now, routable, free_set)
                if picked is not None:
                    self._give(picked[0], wid, now, picked[1])
                    break
            else:
                return

    def _serves(self, wid: str, ticket: Ticket, now: float, routable: dict) -> bool:
        ids = routable.get(ticket.model)
        if ids is None:
            ids = routable[ticket.model] = frozenset(self.fleet.view(now, ticket.model).ids)
        return wid in ids

    def _best_for(
        self, wid: str, now: float, routable: dict, free: frozenset[str]
    ) -> tuple[Ticket, str] | None:
        """The waiting request w's seat goes to, and where it stands against its best
        worker (a `PLACED` name)."""
        waiting = [t for t in self.tenants if t.waiting]
        if not any(t.credit > 0 for t in waiting):
            # A new round: each waiting tenant gains weight x quantum, as many times as
            # it takes for one of them to have credit again.
            quanta = [_round_credit(t.weight * self.config.queue_quantum) for t in waiting]
            rounds = min(_rounds(t.credit, q) for t, q in zip(waiting, quanta, strict=True))
            for t, q in zip(waiting, quanta, strict=True):
                t.credit += rounds * q
        best, best_key = None, None
        for tenant in waiting:
            # A tenant without credit is looked at too, behind every one with credit in
            # the same class: it takes the seat only when no one else can use it.
            broke = tenant.credit <= 0
            prefilling = self.prefilling.of(wid, tenant)
            for queue in tenant.queues:
                for ticket in itertools.islice(queue, SCAN):
                    if not self._serves(wid, ticket, now, routable):
                        continue
                    if self._refreshes and now - ticket.units_at >= REFRESH_S:
                        self._refreshes -= 1
                        self._predict(ticket, now)
                    here = ticket.units.get(wid, 0.0)
                    away = ticket.best != wid and ticket.best_units > here
                    if (
                        away
                        and ticket.best in free
                        and self._serves(ticket.best, ticket, now, routable)
                    ):
                        continue  # 0a: its best worker's seat is free in this pass
                    if now >= ticket.critical_at:
                        key: tuple = (False, ticket.rank, broke, 0, ticket.deadline, ticket.seq)
                    else:
                        held = (away and ticket.best_units > 2 * here) or (
                            prefilling is not None and InPrefill.extends(ticket, prefilling)
                        )
                        if now >= ticket.urgent_at:
                            key = (held, ticket.rank, broke, 0, ticket.deadline, ticket.seq)
                        else:
                            key = (held, ticket.rank, broke, 1, -here, ticket.seq)
                    if best_key is None or key < best_key:
                        best, best_key = ticket, key
                        where = (
                            "held" if key[0] else "urgent" if key[3] == 0 else "near"
                        ) if away else "best"  # fmt: skip
        return None if best is None else (best, where)

    def _give(self, ticket: Ticket, wid: str, now: float, placed: str) -> None:
        self.stats.placed[placed] += 1
        self._unqueue(ticket)
        ticket.tenant.credit -= 1
        self.seats.take(wid)
        self.active += 1  # admitted now, though its waiter wakes later
        ticket.worker, ticket.seated = wid, now
        self.prefilling.add(ticket, wid)
        ticket.exclude = [w for w in self.fleet.view(now, ticket.model).ids if w != wid]
        ticket.future.set_result(wid)  # type: ignore[union-attr]

    def _unqueue(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        tenant.queues[ticket.rank].remove(ticket)
        tenant.waiting -= 1
        self.waiting -= 1
        if not tenant.waiting:
            tenant.credit = 0.0

    # -- lifecycle ----------------------------------------------------------------------
    async def run(self) -> None:
        """Re-read seats every tick, and give those that came free (the app runs it)."""
        while True:
            await asyncio.sleep(TICK_S)
            self.seats.refresh()
            if self.waiting:
                self.pump()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait for those admitted; True if all finished in time."""
        self.draining = True
        if self.active == 0 and self.waiting == 0:
            return True
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._drained), timeout)
        except TimeoutError:
            return False
        return True

    def seat(self, ticket: Ticket) -> Seat:
        """`async with queue.seat(ticket) as seat:` admitted (or refused) on entry; the
        seat is freed on exit, whatever the way out."""
        return Seat(self, ticket)


def _draining() -> APIError:
    return APIError(
        503, "the router is shutting down", code="draining", headers={"Retry-After": "1"}
    )


def _round_credit(quantum: float) -> float:
    """A tenant's credit per round (weight x queue_quantum) within what the config allows
    (NaN as the least): `_rounds` divides by it."""
    return min(quantum, MAX_ROUND_CREDIT) if quantum >= MIN_ROUND_CREDIT else MIN_ROUND_CREDIT


def _rounds(credit: float, per_round: float) -> int:
    """How many rounds of `per_round` make `credit` positive, at most MAX_ROUNDS (also for
    an infinite or NaN quotient, where `math.floor` would raise)."""
    need = -credit / per_round
    return math.floor(need) + 1 if need < MAX_ROUNDS else MAX_ROUNDS
