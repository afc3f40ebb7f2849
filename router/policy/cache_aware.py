"""The default policy, ``cache_aware``: pick a worker from load and the prefix trees.

The routing rule (``cache_aware``; every threshold is a ``RouterConfig`` key)
=============================================================================
Inputs: the request text, and for each routable worker its load (requests in flight
from this router + the queue it reports) and its tree (what it probably caches).
``rate(w) = matched chars on w / text chars``. With a ``tokenizer`` configured the tree
keys on the prompt ids instead, and every length below is in tokens.

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

Always: the text is then inserted into the chosen worker's tree (so a spill
replicates the prefix). Remaining ties (equal load) are broken by the injected
``random.Random``, so a cold fleet spreads new prefixes instead of piling them on
the first worker. Each worker's tree is capped at
``kv_capacity_tokens × chars per token`` chars (unknown capacity: no cap; chars per
token learned from the worker's answers, router/fleet/calibration.py, and
``tree_chars_per_token`` until then) and
all trees together at ``tree_max_chars`` stored chars (router/policy/tree.py).

``router/policy/cost_aware.py`` builds on this one (same trees, caps and epochs) and
routes on predicted time to first token instead. The other policies (load only) are in
``router/policy/simple.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from itertools import compress, repeat
from operator import eq, is_not

from router.policy.base import Decision, Policy, RouteRequest, WorkerView, least_index, view_columns
from router.policy.kv_score import KvScorer, Path
from router.policy.tree import PrefixTree
from shared.config import RouterConfig

_NOT_NONE = partial(is_not, None)


class CacheAware(Policy):
    """The rule at the top of this module.

    Cost per request: the tree walk (independent of the fleet), a few C-level passes
    over the views (ids, loads, capacities: ``map``/``min``/``count``, ~10 ns a
    worker) and Python work only for the holders of the deepest matching node.
    No per-tenant dict of match lengths is built.
    """

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._cfg = config
        self._rng = rng
        self._tree: PrefixTree = PrefixTree(max_chars=config.tree_max_chars)  # type: ignore[type-arg]
        # With a tokenizer the tree keys on the prompt ids (the worker's own units): matches,
        # rates and caps are in tokens and no chars-per-token guess enters (issue 26).
        self._on_tokens = config.tokenizer is not None
        self._capacity: dict[str, int] = {}  # last capacity applied per worker, in tokens
        # Chars per token per worker, learned from answers (router/fleet/calibration.py);
        # absent: the configured ``tree_chars_per_token``.
        self._chars_per_token: dict[str, float] = {}
        # The fleet as last seen: ids in view order, their positions, their capacities.
        # Fleets change rarely, so comparing the lists (C, identity-fast) skips rebuilds.
        self._ids: Sequence[str] = ()
        self._pos: dict[str, int] = {}
        self._caps: Sequence[int] | None = None
        self.kv: KvScorer | None = None  # the exact index beside the tree, when on

    def _follow_fleet(self, workers: Sequence[WorkerView]) -> tuple[Sequence[str], Sequence[int]]:
        """The view's ids and loads; positions and tree caps follow when the fleet changed."""
        ids, loads, caps = view_columns(workers)
        if ids is not self._ids and ids != self._ids:
            self._ids, self._pos = ids, dict(zip(ids, range(len(ids)), strict=True))
            self._caps = None
        if caps is not self._caps and caps != self._caps:
            self._follow_capacity(caps)
        return ids, loads

    def _key(self, request: RouteRequest) -> tuple[str | tuple[int, ...], int]:
        """What the tree keys this request on, and the request's length in the units the
        tree and the caps count: the prompt ids where the router tokenizes (``tokenizer``
        set), else the routing text (chars)."""
        ids = request.tokens
        if self._on_tokens and ids is not None:
            if type(ids) is not tuple:
                # A plain tuple of ints (an int64 array's items would compare one by one
                # in Python). The tokenizer's PromptIds is a tuple already: sliced whole
                # (a copy of pointers), so the tree never keeps its block-key chain.
                ids = (
                    ids[:]
                    if isinstance(ids, tuple)
                    else tuple(ids.tolist() if hasattr(ids, "tolist") else ids)
                )
            return ids, len(ids)
        return request.text, len(request.text)

    def _path(self, request: RouteRequest, key: str | tuple[int, ...], now: float) -> Path:
        path = self._tree.match_path(key) if key else []
        if (
            self.kv is not None and request.tokens is not None
        ):  # the workers' own reports (kv_score.py), in the tree's units
            path = self.kv.correct(
                path, request.tokens, request.model, len(key), now, self._tree.overflowed_at
            )
        return path

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        key, n = self._key(request)
        ids, loads = self._follow_fleet(workers)
        path = self._path(request, key, now)
        i, reason = self._choose(n, loads, path)
        wid = ids[i]
        # Before the insert: ``path`` holds the live holder dicts, which it updates.
        matched = next((end for held, end in reversed(path) if wid in held), 0)
        self._tree.insert(key, wid, now)
        rate = matched / n if n else 0.0
        tokens = request.tokens
        if type(key) is tuple:  # the match is in tokens already
            return Decision(wid, reason, matched, rate, float(matched))
        return Decision(
            wid, reason, matched, rate, rate * len(tokens) if tokens is not None else None
        )

    def predict(self, request: RouteRequest) -> dict[str, float]:
        """Per worker, the prefix of the request its tree holds (chars, or tokens)."""
        key, _ = self._key(request)
        return self._tree.match(key) if key else {}  # type: ignore[return-value]

    def _holders(self, held: Iterable[object]) -> list[int]:
        """Positions of the routable workers among ``held``, in view order."""
        return sorted(filter(_NOT_NONE, map(self._pos.get, held)))  # type: ignore[arg-type]

    def _choose(
        self, n: int, loads: list[int], path: list[tuple[Mapping[object, float], int]]
    ) -> tuple[int, str]:
        cfg, rng = self._cfg, self._rng
        low = min(loads)
        if cfg.balance_mode == "fleet":
            high = max(loads)
            if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
                return least_index(loads, rng, low), "balance"
        threshold = cfg.cache_threshold * n
        # Deepest entry first: its routable holders are the best match. Entries at or
        # below the threshold end the search (shallower ones are shorter still).
        best: list[int] = []
        for held, end in reversed(path):
            if end <= threshold:
                break
            best = self._holders(held)
            if best:
                break
        if not best:
            return self._no_match(loads, low), "no_match"
        pick = best[least_index([loads[j] for j in best], rng)]
        if cfg.balance_mode == "fleet":
            return pick, "cache_hit"
        mean = sum(loads) / len(loads)
        limit = max(mean * cfg.balance_rel_threshold, mean + cfg.balance_abs_threshold)
        if loads[pick] <= limit:  # not overloaded
            return pick, "cache_hit"
        # Every holder above the threshold: the holders of the shallowest such entry.
        above = next(held for held, end in path if end > threshold)
        holders = [j for j in self._holders(above) if loads[j] <= limit]
        if holders:
            return holders[least_index([loads[j] for j in holders], rng)], "spill"
        return least_index(loads, rng, low), "spill"

    def _no_match(self, loads: list[int], low: int) -> int:
        # Ties among the least loaded stay random: breaking them by tree size was
        # measured worse (mooncake, 64 workers: max/mean 1.54 vs 1.32), as every
        # idle-tied request then lands on the one worker that just evicted most.
        if self._cfg.no_match == "least_load":
            return least_index(loads, self._rng, low)
        sizes = self._tree.tenant_sizes(self._ids)
        smallest = min(sizes)
        tied = list(compress(range(len(sizes)), map(eq, sizes, repeat(smallest))))
        return tied[least_index([loads[j] for j in tied], self._rng)]

    def remove_worker(self, worker_id: str) -> None:
        self._tree.remove_tenant(worker_id)
        self._capacity.pop(worker_id, None)
        self._chars_per_token.pop(worker_id, None)
        self._caps = None  # a worker that comes back must get its cap again

    def _set_capacity(self, worker_id: str, cache_tokens: int) -> None:
        self._capacity[worker_id] = cache_tokens
        per_token = (
            1.0
            if self._on_tokens
            else self._chars_per_token.get(worker_id, self._cfg.tree_chars_per_token)
        )
        cap = int(cache_tokens * per_token) if cache_tokens > 0 else None
        self._tree.set_cap(worker_id, cap)

    def calibrate(self, worker_id: str, chars_per_token: float) -> None:
        # The cap follows a change of more than 10% (an EWMA moves a little every answer;
        # re-capping on each would evict a little on each).
        old = self._chars_per_token.get(worker_id, self._cfg.tree_chars_per_token)
        if abs(chars_per_token - old) <= 0.1 * old and worker_id in self._chars_per_token:
            return
        self._chars_per_token[worker_id] = chars_per_token
        cache_tokens = self._capacity.get(worker_id)
        if cache_tokens:
            self._set_capacity(worker_id, cache_tokens)

    def _follow_capacity(self, caps: Sequence[int]) -> None:
        # The one channel capacity reaches the policy by: the views carry the capacity
        # each worker last reported; unknown (0) changes nothing. Called only when the
        # capacities differ from the last request's (rare).
        known = self._capacity
        for wid, cap in zip(self._ids, caps, strict=True):
            if cap and known.get(wid) != cap:
                self._set_capacity(wid, cap)
        self._caps = caps

    def observe(self, worker_id: str, key: str | tuple[int, ...], now: float) -> None:
        # Another replica's decision, keyed as its tree keyed it (router/fleet/sync.py:
        # the prompt ids where the routers tokenize, with the same tokenizer). A key of the
        # other kind would count chars against a cap in tokens, or the reverse: skipped.
        if (type(key) is tuple) == self._on_tokens and key:
            self._tree.insert(key, worker_id, now)

    def worker_stats(self) -> dict[str, dict[str, int]]:
        tree = self._tree
        return {
            str(t): {"tree_chars": tree.tenant_size(t), "tree_nodes": tree.tenant_nodes(t)}
            for t in tree.tenants()
        }
