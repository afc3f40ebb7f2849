"""What every routing policy is: the base class, its input (the request and the routable
fleet) and its output (a decision).

A policy is pure selection: no I/O, state only what it itself learns. The fleet comes as
any ``Sequence[WorkerView]``; a ``FleetView`` keeps the same data as columns across
requests (the router's table maintains one), so a policy reads a fleet of 1,000 without
touching 1,000 objects. The helpers here are the C-level passes every policy shares (no
Python loop per worker: they run on every request).

A new policy subclasses ``Policy``, sets ``name`` and is added to the factory in
``router/policy/__init__.py``; its rule and thresholds are documented at the top of its
own module, as ``cache_aware``'s are.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import attrgetter, eq
from typing import ClassVar


@dataclass(frozen=True)
class RouteRequest:
    text: str  # canonical text to route on
    session_key: str | None = None  # consistent_hash: header value or the OpenAI `user` field
    tokens: Sequence[int] | None = None  # the worker's prompt ids (router `tokenizer` set)
    model: str = ""


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: str  # cache_hit | balance | no_match | spill | <policy name>
    matched_chars: int = 0  # predicted cached prefix length (chars) on the chosen worker
    match_rate: float = 0.0
    predicted_tokens: float | None = None  # the same in tokens, where the prompt ids are known


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    load: int  # requests in flight from this router + queue the worker reports
    kv_capacity_tokens: int = 0


@dataclass(frozen=True)
class WorkerCosts:
    """What a worker's heartbeat says a new request would wait for (cost_aware's inputs;
    `shared.registry.WorkerRecord` carries them). Zeros: unknown."""

    queued_prefill_tokens: int = 0  # waiting prompts + the unprefilled rest of running ones
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0  # one decode step
    max_running_requests: int = 0  # seats: requests beyond these wait
    request_ms: float = 0.0  # how long an admitted request holds its seat (recent mean)
    hit_rate: float = 0.0  # share of its prompt tokens found cached (so far)


class FleetView(Sequence[WorkerView]):
    """The routable fleet as parallel columns that the caller keeps between requests.

    Any ``Sequence[WorkerView]`` works; this one spares the policies their per-request
    passes over the fleet (reading ids, loads and capacities out of n objects costs
    ~50 ns a worker each: 0.15 ms per request at 1,000 workers on the dev box).
    Contract: ``ids`` and ``capacities`` are tuples the caller *replaces* when the
    fleet or a capacity changes (rare; the policy notices by identity), and ``loads``
    is a list it writes in place (``loads[i] = ...``) as loads move. Policies only read.
    """

    __slots__ = ("capacities", "ids", "loads")

    def __init__(
        self,
        ids: Sequence[str],
        loads: list[int] | None = None,
        capacities: Sequence[int] | None = None,
    ) -> None:
        self.ids = tuple(ids)
        self.loads = loads if loads is not None else [0] * len(self.ids)
        self.capacities = tuple(capacities) if capacities is not None else (0,) * len(self.ids)
        if not len(self.loads) == len(self.capacities) == len(self.ids):
            raise ValueError("ids, loads and capacities must have one entry per worker")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> WorkerView:  # type: ignore[override]
        return WorkerView(self.ids[i], self.loads[i], self.capacities[i])


_ID = attrgetter("worker_id")
_LOAD = attrgetter("load")
_CAP = attrgetter("kv_capacity_tokens")


def least_index(loads: list[int], rng: random.Random, low: int | None = None) -> int:
    """Position of the least load; ties random. C-level passes only (map, count,
    compress), no Python work per worker: this runs on every request of the fleet."""
    if low is None:
        low = min(loads)
    tied = loads.count(low)
    if tied == 1:
        return loads.index(low)
    # The k-th tied position, k uniform (the same draw as rng.choice over the tied
    # list), found by a C iterator that stops there instead of building the list.
    k = rng.randrange(tied)
    return next(islice(compress(range(len(loads)), map(eq, loads, repeat(low))), k, None))


def columns(
    workers: Sequence[WorkerView],
) -> tuple[Sequence[str], list[int], Sequence[int]]:
    """(ids, loads, capacities): a FleetView's own lists, else one pass each."""
    if isinstance(workers, FleetView):
        return workers.ids, workers.loads, workers.capacities
    return list(map(_ID, workers)), list(map(_LOAD, workers)), list(map(_CAP, workers))


def loads_of(workers: Sequence[WorkerView]) -> list[int]:
    return workers.loads if isinstance(workers, FleetView) else list(map(_LOAD, workers))


class Policy(ABC):
    """Pure selection: no I/O, state only what the policy itself learns."""

    name: ClassVar[str]

    @abstractmethod
    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        """``workers`` is non-empty and routable (the caller filters). Capacities reach
        the policy only here, in ``WorkerView.kv_capacity_tokens``."""

    # Only policies with per-worker state override these; the rest have none to keep.
    def remove_worker(self, worker_id: str) -> None:
        """Worker left or restarted (new epoch, empty cache): forget what we knew."""
        return

    def set_costs(self, worker_id: str, costs: WorkerCosts) -> None:
        """The worker's heartbeat: what a new request would wait for there (cost_aware)."""
        return

    def observe(self, worker_id: str, text: str, now: float) -> None:
        """Another router replica sent ``text`` to ``worker_id``."""
        return

    def worker_stats(self) -> dict[str, dict[str, int]]:
        return {}


def least_loaded(workers: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    return workers[least_index(loads_of(workers), rng)]
