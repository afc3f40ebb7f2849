"""cost_aware's per-worker inputs as numpy columns in the fleet's order, and its price
over all of them at once (the rule: router/policy/cost_aware.py's docstring).

Why columns: priced in Python, one list comprehension per term over the fleet, a
decision cost O(workers) at ~1 µs a worker (policy-cost benchmark: 244 / 881 µs at
256 / 1,000 workers against cache_aware's 19 / 38), and every changed heartbeat rebuilt
every column (half of that). Here a new heartbeat writes its worker's row (`report`, O(1));
a fleet change rebuilds them all (`rebuild`, rare); a request runs ~16 array operations
of ~1 µs each whatever the fleet's size (`price`): 49 / 52 µs at 256 / 1,000 workers.
Up to a dozen workers lists are cheaper than arrays' fixed cost (`price_small`): in the
simulator, where each decision runs between engine steps as in a router between
requests, 8 workers cost 117–194 µs a decision with it and 290–298 µs without it
(loadtests/results/routing.md, "One price path?"); back to back, the policy-cost
benchmark cannot tell them apart.

Exactness: each array expression performs the reference's float operations in the same
order (IEEE doubles, one rounding per operation, as Python's floats), and integers
(loads, seats, tokens) are exact in a double below 2**53, so every price, every tie and
therefore every decision is the one the per-worker Python made
(tests/router/policy/test_cost_equivalence.py replays both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord

_NO_SEAT_LIMIT = float(1 << 62)  # unknown seats: so many that none is ever short
_MAX_PREFILL_US = 1e6  # a report above this (1 s a token) is garbage: Redis is untrusted
_MAX_MS = 1e7
_MAX_QUEUED = 1 << 40


class Figures(NamedTuple):
    """What cost_aware reads of a worker's heartbeat (`WorkerRecord`), cleaned. Zeros:
    unknown."""

    queued_prefill_tokens: int  # waiting prompts + the unprefilled rest of running ones
    prefill_us_per_token: float
    decode_ms_per_token: float  # one decode step
    max_running_requests: int  # seats: requests beyond these wait
    request_ms: float  # how long an admitted request holds its seat (recent mean)
    hit_rate: float  # share of its prompt tokens found cached (so far)
    # What a cached token costs to bring back, expected (ms): the share of its hits the
    # worker served from its host tier x a host token's load (KV bytes / bandwidth).
    host_load_ms: float = 0.0


UNKNOWN = Figures(0, 0.0, 0.0, 0, 0.0, 0.0)


def _clean(value: float, high: float) -> float:
    """A reported figure as a usable number: NaN, negative or absurd → 0 (unknown)."""
    return value if isinstance(value, int | float) and 0 <= value <= high else 0.0


def figures(report: WorkerRecord | None) -> Figures:
    """The figures of a heartbeat (None: the worker reports none)."""
    if report is None:
        return UNKNOWN
    prompt = report.prompt_tokens_total
    hit = report.cached_tokens_total / prompt if prompt else 0.0
    return Figures(
        int(_clean(report.queued_prefill_tokens, _MAX_QUEUED)),
        _clean(report.prefill_us_per_token, _MAX_PREFILL_US),
        _clean(report.decode_ms_per_token, _MAX_MS),
        int(_clean(report.max_running_requests, _MAX_QUEUED)),
        _clean(report.request_ms, _MAX_MS),
        min(1.0, _clean(hit, 1.0)),
        _host_load_ms(report),
    )


def _host_load_ms(report: WorkerRecord) -> float:
    """A host tier's load price per cached token, in expectation (0.0: no tier, or no
    figures to price it by): the router's tree does not know a prefix's tier, the worker
    knows what share of its hits came from the host."""
    cached, rate = report.cached_tokens_total, _clean(report.host_load_bytes_per_s, 1e15)
    if not cached or not rate:
        return 0.0
    share = min(1.0, _clean(report.host_cached_tokens_total / cached, 1.0))
    return share * _clean(report.kv_bytes_per_token, 1e9) / rate * 1e3


class CostColumns:
    """One row per worker of the fleet the columns were built for (its view order)."""

    __slots__ = (
        "_cfg", "decode_ms", "drain_per_s", "hit_ms", "own_queue", "prefill_ms",
        "reported_at", "reported_queue", "seat_interval_ms", "seats", "seats_less_one",
    )  # fmt: skip

    def __init__(self, config: RouterConfig) -> None:
        self._cfg = config
        empty = np.zeros(0)
        self.prefill_ms = empty  # ms per prefill token
        self.hit_ms = empty  # ms a cached token saves: its prefill less its host load
        self.decode_ms = empty  # cost_decode_weight × ms per decode step
        self.reported_queue = empty  # reported prefill tokens it will not find cached
        self.reported_at = empty  # when the router read that report
        self.drain_per_s = empty  # prefill tokens a second: how fast that queue drains
        self.own_queue = empty  # this router's own uncached tokens sent there, not yet due
        self.seats = empty  # requests it runs at once (unknown: more than any load)
        self.seats_less_one = empty  # a load above this waits for a seat
        self.seat_interval_ms = empty  # a seat frees every this many ms

    def rebuild(
        self,
        ids: Sequence[str],
        rows: Sequence[Figures],
        reported_at: Sequence[float],
        own: Mapping[str, int],
    ) -> None:
        """Every row for the fleet ``ids`` (it changed: a join, a leave, a new epoch)."""
        n = len(ids)
        self.prefill_ms, self.decode_ms, self.hit_ms = np.zeros(n), np.zeros(n), np.zeros(n)
        self.reported_queue, self.drain_per_s = np.zeros(n), np.zeros(n)
        self.seats, self.seats_less_one, self.seat_interval_ms = (
            np.zeros(n),
            np.zeros(n),
            np.zeros(n),
        )
        for i, row in enumerate(rows):
            self.report(i, row)
        self.reported_at = np.array(reported_at, dtype=np.float64)
        self.own_queue = np.array([own.get(w, 0) for w in ids], dtype=np.float64)

    def report(self, i: int, c: Figures) -> None:
        """Row ``i`` from the worker's figures; the report's time is written apart."""
        cfg = self._cfg
        prefill_ms = (c.prefill_us_per_token or cfg.cost_prefill_us_per_token) / 1e3
        self.prefill_ms[i] = prefill_ms
        # A cached token on a host tier is loaded, not free: it saves its prefill less
        # its expected load (p - 0.0 is exact: without a tier, the prices are unchanged).
        self.hit_ms[i] = max(0.0, prefill_ms - c.host_load_ms)
        self.decode_ms[i] = cfg.cost_decode_weight * (
            c.decode_ms_per_token or cfg.cost_decode_ms_per_token
        )
        # A waiting prompt is reported whole (its hit is known only at admission): count
        # the share the worker's hit rate says it will not find cached. Unscaled, a holder
        # whose queue was its own group's mostly cached prompts looked busy, and the
        # spills this caused halved the shared-prefix hit rate (loadtests/results/routing.md).
        self.reported_queue[i] = c.queued_prefill_tokens * (1.0 - c.hit_rate)
        self.drain_per_s[i] = 1e3 / prefill_ms
        known = c.max_running_requests and c.request_ms
        self.seats[i] = seats = c.max_running_requests if known else _NO_SEAT_LIMIT
        self.seats_less_one[i] = seats - 1  # exact: integers below 2**53
        self.seat_interval_ms[i] = c.request_ms / c.max_running_requests if known else 0.0

    def price(
        self,
        loads: Sequence[int],
        now: float,
        tokens: float,
        miss_weight: float,
        stall_weight: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(price, miss weight, stalled requests) per worker for a request of ``tokens``
        with nothing cached; a holder's price then drops by
        miss weight × prefill_ms × its cached tokens."""
        # The one O(fleet) pass in Python's objects (~20 ns a worker): loads move per
        # request, written in place by the table. As int64, the fastest conversion here
        # (1,000 workers: 20 µs against 30 for float64); the terms below cast it exactly.
        # Loads are counts (`WorkerView.load: int`; the registry parses them with int()).
        load = np.fromiter(loads, np.int64, len(loads))
        # The reported queue, less what the worker has prefilled since (at its rate), or
        # this router's own tokens sent there, whichever is larger.
        aged = self.reported_queue - (now - self.reported_at) * self.drain_per_s
        queued = np.maximum(self.own_queue, aged)
        # Requests waiting for a seat there, this one included: each also waits out this
        # request's prefill, so its uncached tokens count once more per waiting request.
        waits = load - self.seats_less_one
        np.maximum(waits, 0.0, out=waits)
        # ... and each request running there has its next token stalled by it.
        stalled = np.minimum(load, self.seats)
        if stall_weight != 1.0:  # × 1.0 is exact: skipped (one array operation fewer)
            stalled *= stall_weight
        weights = miss_weight + waits + stalled
        price = (
            self.prefill_ms * (queued + weights * tokens)
            + self.decode_ms * load
            + waits * self.seat_interval_ms
        )
        return price, weights, stalled

    def price_small(
        self,
        loads: Sequence[int],
        now: float,
        tokens: float,
        miss_weight: float,
        stall_weight: float,
    ) -> tuple[list[float], list[float], list[float]]:
        """`price` as lists, term by term the same, for a small fleet (see the module's
        docstring for why a second path)."""
        prefill_ms = self.prefill_ms.tolist()
        aged = [
            queue - (now - at) * rate
            for queue, at, rate in zip(
                self.reported_queue.tolist(), self.reported_at.tolist(),
                self.drain_per_s.tolist(), strict=True,
            )
        ]  # fmt: skip
        queued = [max(own, a) for own, a in zip(self.own_queue.tolist(), aged, strict=True)]
        waits = [
            max(load - less, 0.0)
            for load, less in zip(loads, self.seats_less_one.tolist(), strict=True)
        ]
        stalled = [
            stall_weight * min(load, seats)
            for load, seats in zip(loads, self.seats.tolist(), strict=True)
        ]
        weights = [miss_weight + w + s for w, s in zip(waits, stalled, strict=True)]
        price = [
            ms * (q + weight * tokens) + decode * load + wait * interval
            for ms, q, weight, decode, load, wait, interval in zip(
                prefill_ms, queued, weights, self.decode_ms.tolist(), loads, waits,
                self.seat_interval_ms.tolist(), strict=True,
            )
        ]  # fmt: skip
        return price, weights, stalled
