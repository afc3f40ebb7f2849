"""The policies that read load only (or nothing): baselines and ablations for cache_aware.

- ``round_robin``: the next worker in view order.
- ``random``: uniform over the routable workers (the injected ``random.Random``).
- ``least_load``: the least loaded; ties random.
- ``power_of_two``: two distinct random workers, the less loaded; ties to the first drawn.
- ``consistent_hash``: rendezvous hashing of the session key, or of the first
  ``HASH_PREFIX_CHARS`` chars of the text when there is none: when a worker joins or
  leaves only the keys it wins or held move.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from router.policy.base import Decision, Policy, Prediction, WorkerView, least_loaded

HASH_PREFIX_CHARS = 256  # consistent_hash key when no session key: the prompt's head


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        w = workers[self._next % len(workers)]
        self._next += 1
        return Decision(w.worker_id, self.name)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        return Decision(self._rng.choice(workers).worker_id, self.name)


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        return Decision(least_loaded(workers, self._rng).worker_id, self.name)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        if len(workers) == 1:
            return Decision(workers[0].worker_id, self.name)
        i, j = self._rng.sample(range(len(workers)), 2)  # indices: no copy of the fleet
        a, b = workers[i], workers[j]
        return Decision((b if b.load < a.load else a).worker_id, self.name)


class ConsistentHash(Policy):
    name = "consistent_hash"

    def select(self, prediction: Prediction, workers: Sequence[WorkerView], now: float) -> Decision:
        request = prediction.request
        key = request.session_key or request.text[:HASH_PREFIX_CHARS]
        best = max(workers, key=lambda w: _score(key, w.worker_id))
        return Decision(best.worker_id, self.name)


def _score(key: str, worker_id: str) -> bytes:
    # Rendezvous (highest random weight): a stable hash, not hash(), so every router
    # replica and every restart agrees. The separator keeps ("ab","c") != ("a","bc").
    return hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest()
