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
- A host KV tier: a cached token the worker must load from host memory saves its
  prefill less its load (KV bytes per token / load bandwidth, both reported). The tree
  does not know a prefix's tier, so each of the ``m(w)`` cached tokens is priced at the
  expected load: the share of the worker's hits served from its host tier × a host
  token's load; the holder's price drops by ``weight × (prefill(w) − that)`` per cached
  token instead of ``weight × prefill(w)``. (The tree's cap follows device + host
  capacity, so ``m(w)`` may lie on the host.)
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
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import compress, repeat
from operator import eq, is_not, itemgetter, ne

import numpy as np

from router.policy.base import Decision, RouteRequest, WorkerView, reports_of
from router.policy.cache_aware import CacheAware
from router.policy.cost_columns import Column, CostColumns, Figures, figures
from shared.config import RouterConfig
from shared.registry import WorkerRecord

_NOT_NONE = partial(is_not, None)
_SMALL = 12  # workers: up to this many priced in lists (policy-cost: lists win at 8, arrays at 16)
# Holders handled one by one up to these counts, above as array operations: each array
# call costs ~1 µs, one holder ~0.7 µs priced (numpy scalars) and ~0.1 µs compared.
_FEW = 16
_MANY = 64


class CostAware(CacheAware):
    """The rule at the top of this module.

    Cost per request: cache_aware's tree walk, ~16 numpy operations over the fleet's
    columns (router/policy/cost_columns.py) and work per holder of the matched text (C
    passes when many); a heartbeat writes its worker's row. policy-cost benchmark:
    244 → 49 µs a decision at 256 workers, 881 → 52 at 1,000, the same decisions
    (loadtests/results/policy_cost.md; tests/router/test_cost_equivalence.py).
    """

    name = "cost_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        # This router's own uncached tokens per worker, until their predicted first token.
        self._own: dict[str, int] = {}
        self._expiry: list[tuple[float, int, str, int]] = []  # (at, seq, worker, tokens)
        self._seq = 0
        # The inputs per worker in the order of ``self._ids``: rebuilt when the fleet
        # changes, a row rewritten when its worker's heartbeat is new.
        self._cols = CostColumns(config)
        self._cols_for: Sequence[str] | None = None
        self._rows: list[Figures] = []  # each row's figures, as priced
        # The heartbeats the rows were read from (the view's column, and a copy of it
        # then) and how many the view had written: a new heartbeat is a new object.
        self._reports: Sequence[WorkerRecord | None] | None = None
        self._read: list[WorkerRecord | None] = []
        self._written: int | None = None

    # -- inputs ------------------------------------------------------------------------
    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._own.pop(worker_id, None)
        self._cols_for = None

    def _read_reports(self, workers: Sequence[WorkerView]) -> None:
        """The heartbeats as the view holds them: every row when the fleet changed, else
        the rows whose heartbeat is a new one (a count says whether any is)."""
        reports, reported_at, written = reports_of(workers)
        cols = self._cols
        if self._cols_for is not self._ids:
            self._rows = list(map(figures, reports))
            cols.rebuild(self._ids, self._rows, reported_at, self._own)
            self._cols_for = self._ids
        elif reports is self._reports and written is not None and written == self._written:
            return
        else:
            rows, t = self._rows, cols.t
            for i in compress(range(len(reports)), map(is_not, reports, self._read)):
                row = figures(reports[i])
                if row != rows[i]:
                    rows[i] = row
                    cols.report(i, row)
                t[i] = reported_at[i]  # the same figures again still mean "as of then"
        self._reports, self._read, self._written = reports, list(reports), written

    # -- the rule ----------------------------------------------------------------------
    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        text = request.text
        ids, loads = self._follow_fleet(workers)
        self._read_reports(workers)
        self._expire(now)
        cols = self._cols
        cfg = self._cfg
        cpt = cfg.tree_chars_per_token
        n = len(text) / cpt
        # A small fleet is priced in lists, a larger one in arrays (the same arithmetic).
        small = len(loads) <= _SMALL
        price = cols.price_small if small else cols.price
        miss, stall = cfg.cost_miss_weight, cfg.cost_stall_weight
        cost, weights, stalled, p = price(loads, now, n, miss, stall)
        matched = self._holders_of(text)  # routable holders: chars cached there
        at, ends = list(matched), list(matched.values())
        save = cols.hit_ms  # ms a cached token saves there: its prefill less its host load
        if small or len(at) <= _FEW:
            for j, end in zip(at, ends, strict=True):
                cost[j] -= weights[j] * float(save[j]) * (end / cpt)
        else:
            where = np.array(at)
            cost[where] -= weights[where] * save[where] * (np.array(ends, np.float64) / cpt)
        i = self._pick(cost, matched, loads)
        longest = max(ends, default=0)
        if matched.get(i, 0) < longest and cfg.cost_hold_margin:
            i = self._hold(i, cost, at, ends, longest)
        wid = ids[i]
        chars = matched.get(i, 0)
        reason = "no_match" if not longest else "cache_hit" if chars == longest else "spill"
        uncached = n - chars / cpt
        # Its own first token: the price less the stall it causes to the running requests.
        ttft = float(cost[i] - stalled[i] * p[i] * uncached)
        self._note_own(i, wid, math.ceil(uncached), now + ttft / 1e3)
        self._tree.insert(text, wid, now)
        return Decision(wid, reason, chars, chars / len(text) if text else 0.0)

    def _holders_of(self, text: str) -> dict[int, int]:
        """Position → chars cached there, for the routable workers holding a prefix of
        ``text``, in the order they first appear on its path (the tie order of `_hold`)."""
        path = self._tree.match_path(text) if text else []
        pos = self._pos
        if not path or len(path[0][0]) <= _FEW:  # a few holders: the plain loop is fastest
            matched: dict[int, int] = {}
            for held, end in path:
                for wid in held:
                    i = pos.get(wid)  # type: ignore[arg-type]
                    if i is not None:
                        matched[i] = end
            return matched
        # Many (a hot prefix on many workers), in C passes. Root side first: a deeper end
        # overwrites a shallower one in place, so the order is the first node's. Each
        # node's holders are a subset of its parent's: a node with as many as its child
        # has the same, all overwritten next (skipped).
        ends: dict[object, int] = dict.fromkeys(path[0][0], path[0][1])
        sizes = list(map(len, map(itemgetter(0), path)))
        for k in compress(range(1, len(path)), map(ne, sizes[1:], [*sizes[2:], -1])):
            held, end = path[k]
            ends.update(zip(held, repeat(end)))
        found = list(map(pos.get, ends))  # type: ignore[arg-type]
        keep = list(map(_NOT_NONE, found))
        return dict(zip(compress(found, keep), compress(ends.values(), keep), strict=True))

    def _hold(
        self, i: int, cost: Column | list[float], at: list[int], ends: list[int], longest: int
    ) -> int:
        """The best holder of the longest match instead of ``i`` when ``i`` is predicted
        faster by no more than ``cost_hold_margin`` of the holder's seat intervals."""
        if len(at) > _MANY and isinstance(cost, np.ndarray):
            best = np.array(at)[np.array(ends) == longest]
            h = int(best[np.argmin(cost[best])])  # ties: the first in path order
        else:
            h = min(
                (j for j, c in zip(at, ends, strict=True) if c == longest), key=cost.__getitem__
            )
        return h if cost[h] - cost[i] <= self._cfg.cost_hold_margin * self._cols.seat_ms[h] else i

    def _pick(
        self, cost: Column | list[float], matched: Mapping[int, int], loads: Sequence[int]
    ) -> int:
        if isinstance(cost, list):
            low = min(cost)
            if cost.count(low) == 1:
                return cost.index(low)
            cands = list(compress(range(len(cost)), map(eq, cost, repeat(low))))
        else:
            first = int(cost.argmin())
            if np.count_nonzero(cost == cost[first]) == 1:
                return first
            cands = np.flatnonzero(cost == cost[first]).tolist()
        # Ties: the longer cached match, then the lower load, then at random. C passes:
        # an idle uniform fleet ties hundreds of workers on every request without a hit.
        if matched:
            held = list(map(matched.get, cands, repeat(0)))
            cands = list(compress(cands, map(eq, held, repeat(max(held)))))
        load = list(map(loads.__getitem__, cands))
        cands = list(compress(cands, map(eq, load, repeat(min(load)))))
        return cands[0] if len(cands) == 1 else self._rng.choice(cands)

    # -- own in-flight prefill ---------------------------------------------------------
    def _note_own(self, i: int, wid: str, tokens: int, until: float) -> None:
        if tokens <= 0:
            return
        self._own[wid] = own = self._own.get(wid, 0) + tokens
        self._cols.o[i] = own
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
                self._cols.o[i] = own[wid]
