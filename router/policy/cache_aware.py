"""The default policy, ``cache_aware``: pick a worker from load and the prefix trees.

The routing rule (``cache_aware``; every threshold is a ``RouterConfig`` key)
=============================================================================
Inputs: the holdings room's prediction (router/holdings/room.py: what each worker
probably caches of the request) and each routable worker's load (requests in flight
from this router + the queue it reports). ``rate(w) = matched chars on w / text
chars``. With a ``tokenizer`` configured the room keys on the prompt ids instead, and
every length below is in tokens.

``balance_mode: fleet`` (default; the SGLang / vLLM router rule):
  1. Imbalance: if ``max(load) - min(load) > balance_abs_threshold`` (64) and
     ``max(load) > balance_rel_threshold × min(load)`` (1.5) → the least loaded
     worker. reason ``balance``.
  2. Else if the best ``rate`` is ``> cache_threshold`` (0.3) → the best-matching
     worker; several equally good → the least loaded of them. reason ``cache_hit``.
  3. Else → ``no_match``: the least loaded worker (``no_match: least_load``) or the
     one with the smallest tree, i.e. the most free cache (``smallest_tree``; ties by
     load). reason ``no_match``.

``balance_mode: per_request`` (no fleet-wide check; hot prefixes replicate):
  1. As step 2 above picks ``best``. A worker is *overloaded* when its load is
     ``> mean(load) × balance_rel_threshold`` and ``> mean(load) + balance_abs_threshold``.
     If ``best`` is overloaded → the least loaded non-overloaded worker whose rate is
     also ``> cache_threshold`` or, failing that, the least loaded worker overall.
     reason ``spill``. Otherwise ``best``, reason ``cache_hit``.
  2. Below ``cache_threshold`` → the ``no_match`` rule above.

Always: the room is then told the choice (router/routing.py), so a spill replicates
the prefix. Remaining ties (equal load) are broken by the injected ``random.Random``,
so a cold fleet spreads new prefixes instead of piling them on the first worker.

``router/policy/cost_aware.py`` reads the same prediction and routes on predicted time
to first token instead. The other policies (load only) are in
``router/policy/simple.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import compress, repeat
from operator import eq, is_not

from router.fleet.view import FleetView
from router.holdings.prediction import Path
from router.policy.base import Decision, Policy, Prediction, WorkerView, least_index, view_columns
from shared.config import RouterConfig

_NOT_NONE = partial(is_not, None)


class CacheAware(Policy):
    """The rule at the top of this module.

    Cost per request: a few C-level passes over the views (ids, loads:
    ``map``/``min``/``count``, ~10 ns a worker) and Python work only for the holders of
    the deepest matching entry of the prediction's path.
    """

    name = "cache_aware"
    reads_holdings = True

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._cfg = config
        self._rng = rng
        # The rule's thresholds, read once (the config is frozen), not off the config
        # on every request.
        self._fleet = config.balance_mode == "fleet"
        self._abs = config.balance_abs_threshold
        self._rel = config.balance_rel_threshold
        self._rate = config.cache_threshold
        self._least_load = config.no_match == "least_load"
        # The fleet as last seen: ids in view order and their positions. Fleets change
        # rarely, so comparing the lists (C, identity-fast) skips rebuilds.
        self._ids: Sequence[str] = ()
        self._pos: dict[str, int] = {}

    def _follow_fleet(self, workers: Sequence[WorkerView]) -> tuple[Sequence[str], list[int]]:
        """The view's ids and loads; positions follow when the fleet changed."""
        ids, loads, _ = view_columns(workers)
        if ids is not self._ids and ids != self._ids:
            self._ids, self._pos = ids, dict(zip(ids, range(len(ids)), strict=True))
        return ids, loads

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        # `_follow_fleet` inlined for the router's own view (one call less a request).
        if type(workers) is FleetView:
            ids, loads = workers.ids, workers.loads
        else:
            ids, loads, _ = view_columns(workers)
        if ids is not self._ids and ids != self._ids:
            self._ids, self._pos = ids, dict(zip(ids, range(len(ids)), strict=True))
        path, n = prediction.path, prediction.length
        i, reason, matched = self._choose(n, loads, path, prediction)
        wid = ids[i]
        if matched < 0:  # not a holder found on the path: its own deepest entry
            matched = 0
            for held, end in reversed(path):
                if wid in held:
                    matched = end
                    break
        rate = matched / n if n else 0.0
        if prediction.on_tokens:  # the match is in tokens already
            return Decision(wid, reason, matched, rate, float(matched))
        tokens = prediction.request.tokens
        return Decision(
            wid, reason, matched, rate, rate * len(tokens) if tokens is not None else None
        )

    def _holders(self, held: Iterable[object]) -> list[int]:
        """Positions of the routable workers among ``held``, in view order."""
        return sorted(filter(_NOT_NONE, map(self._pos.get, held)))  # type: ignore[arg-type]

    def _choose(
        self, n: int, loads: list[int], path: Path, prediction: Prediction
    ) -> tuple[int, str, int]:
        """(position, reason, what the path says it holds; -1: not read off the path)."""
        rng = self._rng
        low = min(loads)
        if self._fleet:
            high = max(loads)
            if high - low > self._abs and high > self._rel * low:
                return least_index(loads, rng, low), "balance", -1
        threshold = self._rate * n
        # Deepest entry first: its routable holders are the best match, and they hold
        # exactly its `end` (deeper entries had none). Entries at or below the threshold
        # end the search (shallower ones are shorter still).
        pick = -1
        for held, end in reversed(path):
            if end <= threshold:
                break
            if len(held) == 1:  # one holder (the common entry): no sort, no least_index
                for w in held:
                    pick = self._pos.get(w, -1)  # type: ignore[call-overload]
            else:
                best = self._holders(held)
                if len(best) == 1:
                    pick = best[0]
                elif best:
                    pick = best[least_index([loads[j] for j in best], rng)]
            if pick >= 0:
                matched = end
                break
        if pick < 0:
            return self._no_match(loads, low, prediction), "no_match", -1
        if self._fleet:
            return pick, "cache_hit", matched
        mean = sum(loads) / len(loads)
        limit = max(mean * self._rel, mean + self._abs)
        if loads[pick] <= limit:  # not overloaded
            return pick, "cache_hit", matched
        # Every holder above the threshold: the holders of the shallowest such entry.
        above = next(held for held, end in path if end > threshold)
        holders = [j for j in self._holders(above) if loads[j] <= limit]
        if holders:
            return holders[least_index([loads[j] for j in holders], rng)], "spill", -1
        return least_index(loads, rng, low), "spill", -1

    def _no_match(self, loads: list[int], low: int, prediction: Prediction) -> int:
        # Ties among the least loaded stay random: breaking them by tree size was
        # measured worse (mooncake, 64 workers: max/mean 1.54 vs 1.32), as every
        # idle-tied request then lands on the one worker that just evicted most.
        if self._least_load:
            return least_index(loads, self._rng, low)
        sizes = prediction.stored(self._ids)
        smallest = min(sizes)
        tied = list(compress(range(len(sizes)), map(eq, sizes, repeat(smallest))))
        return tied[least_index([loads[j] for j in tied], self._rng)]
