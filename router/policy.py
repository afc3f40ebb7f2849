"""Routing policies: pick one worker per request from load and the prefix trees.

The routing rule (``cache_aware``; every threshold is a ``RouterConfig`` key)
=============================================================================
Inputs: the request text, and for each routable worker its load (requests in flight
from this router + the queue it reports) and its tree (what it probably caches).
``rate(w) = matched chars on w / text chars``.

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
``cache_capacity_tokens × tree_chars_per_token`` chars (unknown capacity: no cap) and
all trees together at ``tree_max_chars`` stored chars (router/tree.py).

Other policies: ``round_robin``; ``random``; ``least_load`` (ties random);
``power_of_two`` (two distinct random workers, the less loaded; ties to the first
drawn); ``consistent_hash`` (rendezvous hashing of the session key, or of the first
``HASH_PREFIX_CHARS`` chars of the text when there is none: when a worker joins or
leaves only the keys it wins or held move).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from router.tree import PrefixTree
from shared.config import RouterConfig

HASH_PREFIX_CHARS = 256  # consistent_hash key when no session key: the prompt's head


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    load: int  # requests in flight from this router + queue the worker reports
    cache_capacity_tokens: int = 0


@dataclass(frozen=True)
class RouteRequest:
    text: str  # canonical text to route on
    session_key: str | None = None  # consistent_hash: header value or the OpenAI `user` field


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: str  # cache_hit | balance | no_match | spill | <policy name>
    matched_chars: int = 0  # predicted cached prefix length (chars) on the chosen worker
    match_rate: float = 0.0


class Policy(ABC):
    """Pure selection: no I/O, state only what the policy itself learns."""

    name: ClassVar[str]

    @abstractmethod
    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        """``workers`` is non-empty and routable (the caller filters)."""

    # Only policies with per-worker state override these; the rest have none to keep.
    def remove_worker(self, worker_id: str) -> None:
        """Worker left or restarted (new epoch, empty cache): forget what we knew."""
        return

    def set_capacity(self, worker_id: str, cache_tokens: int) -> None:
        """The worker reported its KV capacity; bound what we believe it caches."""
        return

    def observe(self, worker_id: str, text: str, now: float) -> None:
        """Another router replica sent ``text`` to ``worker_id``."""
        return

    def worker_stats(self) -> dict[str, dict[str, int]]:
        return {}


def _least_loaded(workers: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    low = min(w.load for w in workers)
    tied = [w for w in workers if w.load == low]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        w = workers[self._next % len(workers)]
        self._next += 1
        return Decision(w.worker_id, self.name)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        return Decision(self._rng.choice(workers).worker_id, self.name)


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        return Decision(_least_loaded(workers, self._rng).worker_id, self.name)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        if len(workers) == 1:
            return Decision(workers[0].worker_id, self.name)
        a, b = self._rng.sample(list(workers), 2)
        return Decision((b if b.load < a.load else a).worker_id, self.name)


class ConsistentHash(Policy):
    name = "consistent_hash"

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        key = request.session_key or request.text[:HASH_PREFIX_CHARS]
        best = max(workers, key=lambda w: _score(key, w.worker_id))
        return Decision(best.worker_id, self.name)


def _score(key: str, worker_id: str) -> bytes:
    # Rendezvous (highest random weight): a stable hash, not hash(), so every router
    # replica and every restart agrees. The separator keeps ("ab","c") != ("a","bc").
    return hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()


class CacheAware(Policy):
    """The rule at the top of this module."""

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._cfg = config
        self._rng = rng
        self._tree: PrefixTree[str] = PrefixTree(max_chars=config.tree_max_chars)
        self._capacity: dict[str, int] = {}  # last capacity applied per worker, in tokens

    def select(self, request: RouteRequest, workers: Sequence[WorkerView], now: float) -> Decision:
        text = request.text
        self._follow_capacity(workers)
        matches = self._tree.match(text) if text else {}
        chosen, reason = self._choose(len(text), workers, matches)
        self._tree.insert(text, chosen.worker_id, now)
        matched = matches.get(chosen.worker_id, 0)
        rate = matched / len(text) if text else 0.0
        return Decision(chosen.worker_id, reason, matched, rate)

    def _choose(
        self, n: int, workers: Sequence[WorkerView], matches: dict[object, int]
    ) -> tuple[WorkerView, str]:
        cfg = self._cfg
        loads = [w.load for w in workers]
        if cfg.balance_mode == "fleet":
            high, low = max(loads), min(loads)
            if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
                return _least_loaded(workers, self._rng), "balance"
        threshold = cfg.cache_threshold * n
        best_len = max((matches.get(w.worker_id, 0) for w in workers), default=0)
        if n == 0 or best_len <= threshold:
            return self._no_match(workers), "no_match"
        best = _least_loaded(
            [w for w in workers if matches.get(w.worker_id, 0) == best_len], self._rng
        )
        if cfg.balance_mode == "fleet":
            return best, "cache_hit"
        mean = sum(loads) / len(loads)

        def overloaded(w: WorkerView) -> bool:
            return (
                w.load > mean * cfg.balance_rel_threshold
                and w.load > mean + cfg.balance_abs_threshold
            )

        if not overloaded(best):
            return best, "cache_hit"
        holders = [
            w for w in workers if matches.get(w.worker_id, 0) > threshold and not overloaded(w)
        ]
        return _least_loaded(holders or workers, self._rng), "spill"

    def _no_match(self, workers: Sequence[WorkerView]) -> WorkerView:
        if self._cfg.no_match == "least_load":
            return _least_loaded(workers, self._rng)
        size = self._tree.tenant_size
        smallest = min(size(w.worker_id) for w in workers)
        return _least_loaded([w for w in workers if size(w.worker_id) == smallest], self._rng)

    def remove_worker(self, worker_id: str) -> None:
        self._tree.remove_tenant(worker_id)
        self._capacity.pop(worker_id, None)

    def set_capacity(self, worker_id: str, cache_tokens: int) -> None:
        self._capacity[worker_id] = cache_tokens
        cap = int(cache_tokens * self._cfg.tree_chars_per_token) if cache_tokens > 0 else None
        self._tree.set_cap(worker_id, cap)

    def _follow_capacity(self, workers: Sequence[WorkerView]) -> None:
        # The views carry the capacity the worker last reported, so the caps follow it
        # even when the caller never calls set_capacity; unknown (0) changes nothing.
        known = self._capacity
        for w in workers:
            if w.cache_capacity_tokens and known.get(w.worker_id) != w.cache_capacity_tokens:
                self.set_capacity(w.worker_id, w.cache_capacity_tokens)

    def observe(self, worker_id: str, text: str, now: float) -> None:
        self._tree.insert(text, worker_id, now)

    def worker_stats(self) -> dict[str, dict[str, int]]:
        tree = self._tree
        return {
            str(t): {"tree_chars": tree.tenant_size(t), "tree_nodes": tree.tenant_nodes(t)}
            for t in tree.tenants()
        }


def build_policy(config: RouterConfig, rng: random.Random | None = None) -> Policy:
    """The policy ``config.policy`` names, with its randomness from ``rng``."""
    rng = rng if rng is not None else random.Random()
    name = config.policy
    if name == "cache_aware":
        return CacheAware(config, rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy(rng)
    if name == "least_load":
        return LeastLoad(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "consistent_hash":
        return ConsistentHash()
    raise ValueError(f"unknown policy {name!r}")
