"""``cost_aware``: route to the least predicted time to first token (TTFT), priced with
the delay the request's prefill adds to the requests already on the worker.

The rule (every knob is a ``RouterConfig`` key)
===============================================
For each routable worker ``w``, with the request's text of ``n`` tokens
(chars / ``tree_chars_per_token``) of which ``m(w)`` are in ``w``'s tree::

    wait(w)  = max(0, load(w) + 1 − seats(w))          requests waiting for a seat, this one too
    run(w)   = min(load(w), seats(w))                   requests running there
    ttft(w)  = prefill(w) × (queued(w) + (k + wait(w)) × (n − m(w)))
             + wait(w) × request_ms(w) / seats(w)
             + cost_decode_weight × decode(w) × load(w)
    price(w) = ttft(w) + prefill(w) × s × run(w) × (n − m(w))

- ``queued(w)``: prefill tokens already waiting or running on ``w``: the larger of what
  its heartbeat reported (waiting prompts are reported whole: scaled by 1 − the
  worker's hit rate), less what ``w`` has prefilled since at its rate (a report is
  up to a heartbeat plus a discovery interval old: unaged, a queue long drained kept
  traffic away), and this router's own uncached tokens sent since, each counted until
  its own predicted first token, ``ttft`` (so two requests in one heartbeat interval
  see each other; the larger of the two, as for load, counts no token twice).
- ``prefill(w)`` (ms per token), ``decode(w)`` (ms per step), ``seats(w)`` (requests it
  runs at once) and ``request_ms(w)`` (how long one holds its seat): what the worker
  reports (the sim engine reports its cost model); ``cost_prefill_us_per_token`` /
  ``cost_decode_ms_per_token`` for a worker that reports none; unknown seats: no wait.
- ``load(w)``: requests in flight or queued there (the load every policy reads).
- The miss term: the request's uncached tokens count ``k = cost_miss_weight`` times (1:
  its own TTFT) plus once per request waiting for a seat on ``w``, each of which also
  waits out that prefill. Without it, a saturated fleet spread its misses (each
  worker's queue hides the cache's saving), and the extra prefill saturated it further:
  shared prefix at twice the fleet's rate, hit rate 0.625 against cache_aware's 0.882,
  TTFT p50 756 vs 233 ms; with it 0.867 and 301 ms, p99 529 vs 661.
- The stall term, ``s = cost_stall_weight`` (1): a prefill runs in the engine's step,
  so every request running on ``w`` waits out the uncached tokens for its next token.
  A miss on a busy worker therefore costs the fleet its prefill once per request
  there, a hit almost nothing. Without it, with every worker near its batch, a holder
  with one request waiting for a seat (one seat interval, ~19 ms) was predicted slower
  than a miss elsewhere (~16–30 ms of prefill); the flip copied the prefix into a full
  cache and evicted another group's: closed-loop shared prefix in the simulator, hit
  rate 0.613 against cache_aware's 0.882 (live 0.52–0.62 against 0.86).
- The hold margin, ``cost_hold_margin`` (1): the best holder of the longest match keeps
  the request unless another worker's price is lower by more than that many of the
  holder's seat intervals (``request_ms / seats``). The seat wait is predicted in whole
  intervals while the next seat frees anywhere within one: a smaller gap is below the
  prediction's resolution, and acting on it traded a certain hit for a coin flip.

Measured with both terms (loadtests/results/routing.md, "Closing the hit-rate gap"):
live on 4 sim workers, hit rate on shared prefix 0.667 → 0.858 (cache_aware 0.867), Zipf
0.768 → 0.849 (0.857), RAG 0.170 → 0.225–0.230 (0.245–0.248), multi-turn 0.813 → 0.856
(0.683), throughput at or above cache_aware's on each. Each term alone, in the
simulator (closed-loop shared prefix / RAG / Mooncake at 64 workers; before 0.613 /
0.217 / 0.583): the stall 0.853 / 0.242 / 0.605, the margin 0.769 / 0.272 / 0.609, both
0.856 / 0.257 / 0.611. A margin of two intervals kept more hits (0.869 / 0.272 / 0.618)
but spread a hot prefix less: Zipf at 8 workers max/mean 1.25 against 1.17 (target 1.2).

The least ``price`` wins (the hold margin aside); ties go to the longer cached match,
then the lower load, then at random. A long queue therefore loses to an idle worker
unless the cached share saves more than the queue costs, and a hot prefix whose holders
are all busy is sent to the next best worker, whose tree then holds it too (the prefix
is replicated; reason ``spill``). Reasons: ``cache_hit`` (a worker with the longest match
won), ``spill`` (a longer match existed elsewhere), ``no_match`` (no worker holds any of
the text).

Evaluated and left out (simulator, loadtests/results/routing.md): pricing the eviction a
miss causes (uncached tokens beyond the tree's cap × prefill × the worker's reuse,
``hit / (1 − hit)`` capped at 1) moved hit rates by ≤ 1 point at weights 1–10: the holder
evicts its own uncached tokens too, so the term separates holder and non-holder by
only the cached share, which the stall term already prices ``run(w)`` times over.

Everything ``cache_aware`` keeps (its trees, caps per worker, replica observations, a
new epoch dropping a tree) is inherited from it unchanged.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from itertools import compress, repeat
from operator import eq

from router.policy.base import Decision, RouteRequest, WorkerCosts, WorkerView
from router.policy.cache_aware import CacheAware
from shared.config import RouterConfig

_MAX_PREFILL_US = 1e6  # a report above this (1 s a token) is garbage: Redis is untrusted
_MAX_MS = 1e7
_MAX_QUEUED = 1 << 40
_NO_SEAT_LIMIT = 1 << 62


def _clean(value: float, high: float) -> float:
    """A reported figure as a usable number: NaN, negative or absurd → 0 (unknown)."""
    return value if isinstance(value, int | float) and 0 <= value <= high else 0.0


class CostAware(CacheAware):
    name = "cost_aware"

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
