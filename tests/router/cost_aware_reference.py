"""cost_aware as it was before its price went over numpy columns (commit 1ec2f3d),
frozen: the reference that tests/router/policy/test_cost_equivalence.py replays against the
live class, and that ``python -m loadtests policy-cost`` times side by side with it
(policy ``cost_aware_reference``). The rule is documented at the top of
router/policy/cost_aware.py; this copy must not change.

Its input is as it was then: ``set_costs`` per heartbeat, stamped at the next ``select``
(the live class reads the heartbeat from the view, stamped when the router read it; the
harness reads both at the same instant). ``WorkerCosts`` and ``costs_of`` came along
from the router when the heartbeat became one shape (``WorkerRecord``) there.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import eq

from router.holdings.tree import PrefixTree
from router.policy.base import Decision, RouteRequest, WorkerView
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord


@dataclass(frozen=True)
class WorkerCosts:
    """What a worker's heartbeat says a new request would wait for. Zeros: unknown."""

    queued_prefill_tokens: int = 0  # waiting prompts + the unprefilled rest of running ones
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0  # one decode step
    max_running_requests: int = 0  # seats: requests beyond these wait
    request_ms: float = 0.0  # how long an admitted request holds its seat (recent mean)
    hit_rate: float = 0.0  # share of its prompt tokens found cached (so far)


def costs_of(record: WorkerRecord) -> WorkerCosts:
    prompt = record.prompt_tokens_total
    return WorkerCosts(
        record.queued_prefill_tokens, record.prefill_us_per_token, record.decode_ms_per_token,
        record.max_running_requests, record.request_ms,
        record.cached_tokens_total / prompt if prompt else 0.0,
    )  # fmt: skip


_MAX_PREFILL_US = 1e6  # a report above this (1 s a token) is garbage: Redis is untrusted
_MAX_MS = 1e7
_MAX_QUEUED = 1 << 40
_NO_SEAT_LIMIT = 1 << 62


def _clean(value: float, high: float) -> float:
    """A reported figure as a usable number: NaN, negative or absurd → 0 (unknown)."""
    return value if isinstance(value, int | float) and 0 <= value <= high else 0.0


class _TreeOwner:
    """What the policies owned before the holdings room (router/holdings/room.py) took
    it over, frozen with the reference: one text tree, capped per worker by the
    capacity its view carries at ``tree_chars_per_token``."""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._cfg, self._rng = config, rng
        self._tree: PrefixTree[str] = PrefixTree(max_chars=config.tree_max_chars)
        self._capacity: dict[str, int] = {}
        self._ids: Sequence[str] = ()
        self._pos: dict[str, int] = {}
        self._caps: Sequence[int] | None = None

    def _follow_fleet(self, workers: Sequence[WorkerView]) -> tuple[list[str], list[int]]:
        ids = [w.worker_id for w in workers]
        loads = [w.load for w in workers]
        caps = [w.kv_capacity_tokens for w in workers]
        if ids != self._ids:
            self._ids, self._pos = ids, {w: i for i, w in enumerate(ids)}
            self._caps = None
        if caps != self._caps:
            for wid, cap in zip(ids, caps, strict=True):
                if cap and self._capacity.get(wid) != cap:
                    self._capacity[wid] = cap
                    self._tree.set_cap(wid, int(cap * self._cfg.tree_chars_per_token))
            self._caps = caps
        return ids, loads

    def remove_worker(self, worker_id: str) -> None:
        self._tree.remove_tenant(worker_id)
        self._capacity.pop(worker_id, None)
        self._caps = None

    def observe(self, worker_id: str, key: str, now: float) -> None:
        if key:
            self._tree.insert(key, worker_id, now)


class CostAwareReference(_TreeOwner):
    name = "cost_aware_reference"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._costs: dict[str, WorkerCosts] = {}  # as last reported, cleaned
        # This router's own uncached tokens per worker, until their predicted first token.
        self._own: dict[str, int] = {}
        self._report_at: dict[str, float] = {}
        self._expiry: list[tuple[float, int, str, int]] = []  # (at, seq, worker, tokens)
        self._seq = 0
        # Per-worker columns in the order of ``self._ids``; rebuilt when the fleet or a
        # report changes (once per heartbeat read), so a request reads lists, not dicts.
        self._cols_for: Sequence[str] | None = None
        self._p: list[float] = []  # ms per prefill token
        self._kd: list[float] = []  # ms per unit of load
        self._r: list[float] = []  # queued tokens as reported (expected uncached) ...
        self._t: list[float] = []  # ... at this time (the first request after the report)
        self._v: list[float] = []  # ... and drained at this rate (tokens per second)
        self._o: list[int] = []  # this router's own tokens sent there, not yet prefilled
        self._unstamped: set[str] = set()  # reports not yet given a time
        self._seats: list[int] = []  # unknown: so many that none is ever short
        self._seat_ms: list[float] = []  # wait per request beyond the seats

    # -- inputs ------------------------------------------------------------------------
    def set_costs(self, worker_id: str, costs: WorkerCosts) -> None:
        """The worker's heartbeat: its queue of prefill tokens, its step costs, its seats."""
        clean = WorkerCosts(
            int(_clean(costs.queued_prefill_tokens, _MAX_QUEUED)),
            _clean(costs.prefill_us_per_token, _MAX_PREFILL_US),
            _clean(costs.decode_ms_per_token, _MAX_MS),
            int(_clean(costs.max_running_requests, _MAX_QUEUED)),
            _clean(costs.request_ms, _MAX_MS),
            min(1.0, _clean(costs.hit_rate, 1.0)),
        )
        self._unstamped.add(worker_id)  # the same figures again still mean "as of now"
        if self._costs.get(worker_id) != clean:
            self._costs[worker_id] = clean
            self._cols_for = None

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._costs.pop(worker_id, None)
        self._own.pop(worker_id, None)
        self._report_at.pop(worker_id, None)
        self._unstamped.discard(worker_id)
        self._cols_for = None

    # -- the rule ----------------------------------------------------------------------
    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        text = request.text
        ids, loads = self._follow_fleet(workers)
        if self._cols_for is not self._ids:
            self._rebuild_columns(now)
        self._expire(now)
        if self._unstamped:
            self._stamp(now)
        cpt = self._cfg.tree_chars_per_token
        n = len(text) / cpt
        p = self._p
        # The reported queue, less what the worker has prefilled since (at its rate), or
        # this router's own tokens sent there, whichever is larger.
        queued = [
            max(o, r - (now - t) * v)
            for o, r, t, v in zip(self._o, self._r, self._t, self._v, strict=True)
        ]
        cfg = self._cfg
        seats = self._seats
        # Requests waiting for a seat there, this one included: each also waits out this
        # request's prefill, so its uncached tokens count once more per waiting request.
        waits = [max(0, li + 1 - si) for li, si in zip(loads, seats, strict=True)]
        # ... and each request running there has its next token stalled by it.
        stall = cfg.cost_stall_weight
        stalled = [stall * min(li, si) for li, si in zip(loads, seats, strict=True)]
        miss = cfg.cost_miss_weight
        weights = [miss + e + r for e, r in zip(waits, stalled, strict=True)]
        cost = [
            pi * (qi + mi * n) + ki * li + ei * wi
            for pi, qi, mi, ki, li, ei, wi in zip(
                p, queued, weights, self._kd, loads, waits, self._seat_ms, strict=True
            )
        ]
        matched: dict[int, int] = {}  # position -> chars cached there (routable holders)
        pos = self._pos
        for held, end in self._tree.match_path(text) if text else ():
            for wid in held:
                i = pos.get(wid)  # type: ignore[arg-type]
                if i is not None:
                    matched[i] = end
        for i, chars in matched.items():
            cost[i] -= weights[i] * p[i] * (chars / cpt)
        i = self._pick(cost, matched, loads)
        longest = max(matched.values(), default=0)
        if matched.get(i, 0) < longest and cfg.cost_hold_margin:
            i = self._hold(i, cost, matched, longest)
        wid = ids[i]
        chars = matched.get(i, 0)
        reason = "no_match" if not longest else "cache_hit" if chars == longest else "spill"
        uncached = n - chars / cpt
        # Its own first token: the price less the stall it causes to the running requests.
        ttft = cost[i] - stalled[i] * p[i] * uncached
        self._note_own(i, wid, math.ceil(uncached), now + ttft / 1e3)
        self._tree.insert(text, wid, now)
        return Decision(wid, reason, chars, chars / len(text) if text else 0.0)

    def _hold(self, i: int, cost: list[float], matched: dict[int, int], longest: int) -> int:
        """The best holder of the longest match instead of ``i`` when ``i`` is predicted
        faster by no more than ``cost_hold_margin`` of the holder's seat intervals."""
        h = min((j for j, c in matched.items() if c == longest), key=cost.__getitem__)
        return h if cost[h] - cost[i] <= self._cfg.cost_hold_margin * self._seat_ms[h] else i

    def _pick(self, cost: list[float], matched: dict[int, int], loads: list[int]) -> int:
        low = min(cost)
        tied = cost.count(low)
        if tied == 1:
            return cost.index(low)
        # Ties: the longer cached match, then the lower load, then at random.
        cands = list(compress(range(len(cost)), map(eq, cost, repeat(low))))
        best = max(matched.get(i, 0) for i in cands)
        cands = [i for i in cands if matched.get(i, 0) == best]
        least = min(loads[i] for i in cands)
        cands = [i for i in cands if loads[i] == least]
        return cands[0] if len(cands) == 1 else self._rng.choice(cands)

    # -- own in-flight prefill ---------------------------------------------------------
    def _note_own(self, i: int, wid: str, tokens: int, until: float) -> None:
        if tokens <= 0:
            return
        self._own[wid] = self._o[i] = self._own.get(wid, 0) + tokens
        self._seq += 1
        heapq.heappush(self._expiry, (until, self._seq, wid, tokens))

    def _expire(self, now: float) -> None:
        expiry, own = self._expiry, self._own
        while expiry and expiry[0][0] <= now:
            _, _, wid, tokens = heapq.heappop(expiry)
            left = own.get(wid)
            if left is None:
                continue  # the worker left or restarted meanwhile
            own[wid] = max(0, left - tokens)
            i = self._pos.get(wid)
            if i is not None:
                self._o[i] = own[wid]

    def _stamp(self, now: float) -> None:
        for wid in self._unstamped:
            self._report_at[wid] = now
            i = self._pos.get(wid)
            if i is not None:
                self._t[i] = now
        self._unstamped.clear()

    def _rebuild_columns(self, now: float) -> None:
        cfg = self._cfg
        unknown = WorkerCosts()
        costs = [self._costs.get(w, unknown) for w in self._ids]
        self._p = [(c.prefill_us_per_token or cfg.cost_prefill_us_per_token) / 1e3 for c in costs]
        self._kd = [
            cfg.cost_decode_weight * (c.decode_ms_per_token or cfg.cost_decode_ms_per_token)
            for c in costs
        ]
        # A waiting prompt is reported whole (its hit is known only at admission): count
        # the share the worker's hit rate says it will not find cached. Unscaled, a holder
        # whose queue was its own group's mostly cached prompts looked busy, and the
        # spills this caused halved the shared-prefix hit rate (loadtests/results/routing.md).
        self._r = [c.queued_prefill_tokens * (1.0 - c.hit_rate) for c in costs]
        self._t = [self._report_at.get(w, now) for w in self._ids]
        self._v = [1e3 / p for p in self._p]
        self._o = [self._own.get(w, 0) for w in self._ids]
        known = [c.max_running_requests and c.request_ms for c in costs]
        self._seats = [
            c.max_running_requests if k else _NO_SEAT_LIMIT
            for c, k in zip(costs, known, strict=True)
        ]
        self._seat_ms = [
            c.request_ms / c.max_running_requests if k else 0.0
            for c, k in zip(costs, known, strict=True)
        ]
        self._cols_for = self._ids
