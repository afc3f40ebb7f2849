"""``cost_aware``: route to the least predicted time to first token (TTFT), priced with
the delay the request's prefill adds to the requests already on the worker.

The rule (every knob is a ``RouterConfig`` key)
===============================================
For each routable worker ``w``, with the request's text of ``n`` tokens
(chars / ``tree_chars_per_token``; the prompt ids, with a ``tokenizer``) of which ``m(w)`` are in ``w``'s tree::

    wait(w)  = max(0, load(w) + 1 − seats(w))          requests waiting for a seat, this one too
    run(w)   = min(load(w), seats(w))                   requests running there
    ttft(w)  = prefill(w) × (queued(w) + (k + wait(w)) × (n − m(w)))
             + wait(w) × request_ms(w) / seats(w)
             + cost_decode_weight × decode(w) × load(w)
    price(w) = ttft(w) + prefill(w) × s × run(w) × (n − m(w))

The least ``price`` wins; ties go to the longer cached match, then the lower load, then
at random. The best holder of the longest match keeps the request unless another
worker's price is lower by more than ``cost_hold_margin`` of its seat intervals.

- ``load(w)``: requests in flight or queued there (the load every policy reads).
- ``seats(w)``, ``request_ms(w)``: requests it runs at once, how long one holds its seat
  (its heartbeat; unknown: no seat wait).
- ``prefill(w)`` ms a prefill token, ``decode(w)`` ms a decode step: its heartbeat, else
  ``cost_prefill_us_per_token`` / ``cost_decode_ms_per_token``.
- A host KV tier, priced once: where the prediction knows the tiers (a worker's KV-event
  index, ``Prediction.priced_tiers``) its host-held tokens are in ``m(w)`` at their host
  weight already (router/holdings/merge.py) and each saves ``prefill(w)``; where it
  does not (the tree alone), each cached token saves ``prefill(w)`` less its expected
  load: the share of ``w``'s hits served from its host tier × KV bytes per token / load
  bandwidth (its heartbeat). Both at once counted the host tier twice
  (loadtests/results/kv_events.md).
- ``queued(w)``: the larger of its reported prefill queue (× 1 − its hit rate, aged at
  its prefill rate since the router read it) and this router's own uncached tokens sent
  there, each counted until its predicted first token ``ttft``.
- ``k = cost_miss_weight`` (1): the uncached tokens count once for this request's TTFT
  and once more per request waiting there (each waits out the prefill).
- ``s = cost_stall_weight`` (1): every running request waits out the prefill for its
  next token.
- ``cost_hold_margin`` (1): a seat wait is predicted in whole intervals; a smaller gap
  is below the prediction's resolution.

Reasons: ``cache_hit`` (a worker with the longest match won), ``spill`` (a longer match
existed elsewhere: the prefix replicates), ``no_match`` (no worker holds any of the
text). Why each term, measured: loadtests/results/routing.md ("cost_aware:
why each term").
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from itertools import compress, repeat
from operator import eq, is_not, itemgetter, ne

import numpy as np

from router.fleet.cost_columns import CostColumns, Figures, figures
from router.policy.base import Decision, Prediction, WorkerView, reports_of
from router.policy.cache_aware import CacheAware
from shared.config import RouterConfig
from shared.wire.registry import WorkerRecord

_NOT_NONE = partial(is_not, None)
_SMALL = 12  # workers: up to this many priced in lists (cost_columns.py: why)
# Holders handled one by one up to these counts, above as array operations: each array
# call costs ~1 µs, one holder ~0.7 µs priced (numpy scalars) and ~0.1 µs compared.
_FEW = 16
_MANY = 64


class CostAware(CacheAware):
    """The rule at the top of this module.

    Cost per request: ~16 numpy operations over the fleet's
    columns (router/fleet/cost_columns.py) and work per holder of the matched text (C
    passes when many); a new heartbeat writes its worker's row. policy-cost benchmark:
    244 → 49 µs a decision at 256 workers, 881 → 52 at 1,000, the same decisions
    (loadtests/results/policy_cost.md; tests/router/policy/test_cost_equivalence.py).
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
    def _forget(self, forgotten: tuple[str, ...]) -> None:
        """Workers the room forgot (left, restarted): their own queue goes with them."""
        for worker_id in forgotten:
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
            rows = self._rows
            for i in compress(range(len(reports)), map(is_not, reports, self._read)):
                row = figures(reports[i])
                if row != rows[i]:
                    rows[i] = row
                    cols.report(i, row)
                # The same figures again still mean "as of then".
                cols.reported_at[i] = reported_at[i]
        self._reports, self._read, self._written = reports, list(reports), written

    # -- the rule ----------------------------------------------------------------------
    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        if prediction.forgotten:
            self._forget(prediction.forgotten)
        n = prediction.length
        ids, loads = self._follow_fleet(workers)
        self._read_reports(workers)
        self._expire(now)
        cfg, cols = self._cfg, self._cols
        on_tokens = prediction.on_tokens  # the lengths are tokens already
        chars_per_token = 1.0 if on_tokens else cfg.tree_chars_per_token
        tokens = n / chars_per_token
        # A small fleet is priced in lists, a larger one in arrays (the same arithmetic).
        small = len(loads) <= _SMALL
        price_of = cols.price_small if small else cols.price
        price, weights, stalled = price_of(
            loads, now, tokens, cfg.cost_miss_weight, cfg.cost_stall_weight
        )
        # ms a cached token saves there: its prefill, less its load from a host tier.
        hit_ms = cols.hit_ms.tolist() if small else cols.hit_ms
        matched = self._holders_of(prediction.path)  # routable holders: length cached there
        if prediction.index:  # (its workers' host tiers are priced: `priced_tiers`)
            hit_ms = self._tiers_priced(hit_ms, prediction.index, small)
        at, ends = list(matched), list(matched.values())
        # A holder saves its cached tokens × its miss weight. One by one up to _FEW
        # holders (one costs ~0.7 µs in numpy scalars), above in array operations (~1 µs
        # each, whatever their number).
        if small or len(at) <= _FEW:
            for j, end in zip(at, ends, strict=True):
                price[j] -= weights[j] * hit_ms[j] * (end / chars_per_token)
        else:
            where = np.array(at)
            cached = np.array(ends, np.float64) / chars_per_token
            price[where] -= weights[where] * hit_ms[where] * cached  # type: ignore[index]
        i = self._pick(price, matched, loads)
        longest = max(ends, default=0)
        if matched.get(i, 0) < longest and cfg.cost_hold_margin:
            i = self._hold(i, price, at, ends, longest)
        wid = ids[i]
        chars = matched.get(i, 0)
        reason = "no_match" if not longest else "cache_hit" if chars == longest else "spill"
        uncached = tokens - chars / chars_per_token
        # Its own first token: the price less the stall it causes to the running requests.
        ttft = float(price[i] - stalled[i] * cols.prefill_ms[i] * uncached)
        self._note_own(i, wid, math.ceil(uncached), now + ttft / 1e3)
        rate = chars / n if n else 0.0
        if on_tokens:
            return Decision(wid, reason, chars, rate, float(chars))
        ids = prediction.request.tokens  # the prompt ids, where the router has a tokenizer
        return Decision(wid, reason, chars, rate, rate * len(ids) if ids is not None else None)

    def _tiers_priced(
        self, hit_ms: np.ndarray | list[float], priced: Iterable[str], small: bool
    ) -> np.ndarray | list[float]:
        """A cached token's saving per worker, where the prediction priced the worker's
        host tier itself: its whole prefill (the host share is in its match already)."""
        prefill = self._cols.prefill_ms
        out = list(hit_ms) if small else np.array(hit_ms)
        for wid in priced:
            i = self._pos.get(wid)
            if i is not None:
                out[i] = prefill[i] if not small else float(prefill[i])
        return out

    def _holders_of(self, path: list[tuple[Mapping[object, float], int]]) -> dict[int, int]:
        """Position → length cached there (the tree's units), for the routable workers
        holding a prefix of the request, in the order they first appear on its path (the
        tie order of `_hold`)."""
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
        self, i: int, price: np.ndarray | list[float], at: list[int], ends: list[int], longest: int
    ) -> int:
        """The best holder of the longest match instead of ``i`` when ``i`` is predicted
        faster by no more than ``cost_hold_margin`` of the holder's seat intervals."""
        # Array operations (~1 µs each) beat ~0.1 µs per holder compared above _MANY.
        if len(at) > _MANY and isinstance(price, np.ndarray):
            best = np.array(at)[np.array(ends) == longest]
            h = int(best[np.argmin(price[best])])  # ties: the first in path order
        else:
            h = min(
                (j for j, c in zip(at, ends, strict=True) if c == longest), key=price.__getitem__
            )
        margin = self._cfg.cost_hold_margin * self._cols.seat_interval_ms[h]
        return h if price[h] - price[i] <= margin else i

    def _pick(
        self, price: np.ndarray | list[float], matched: Mapping[int, int], loads: Sequence[int]
    ) -> int:
        if isinstance(price, list):
            low = min(price)
            if price.count(low) == 1:
                return price.index(low)
            cands = list(compress(range(len(price)), map(eq, price, repeat(low))))
        else:
            first = int(price.argmin())
            if np.count_nonzero(price == price[first]) == 1:
                return first
            cands = np.flatnonzero(price == price[first]).tolist()
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
        self._cols.own_queue[i] = own
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
                self._cols.own_queue[i] = own[wid]
