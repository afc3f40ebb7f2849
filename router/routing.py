"""One routing decision: the holdings room predicts, the policy selects, the room is told.

    prediction = holdings.predict(request, workers, now)   # what each worker holds
    decision   = policy.select(prediction, workers, now)   # where, from that and the loads
    holdings.routed(prediction, decision.worker_id, now)   # the key goes into its tree
    publish(decision.worker_id, prediction.key)            # and to the other replicas

A load-only policy reads no holdings: its prediction is the request alone, and nothing
enters a tree. `router.policy.build_routing` makes one from a config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.holdings.prediction import Prediction, RouteRequest
from router.holdings.room import Holdings
from router.policy.base import Decision, Policy, WorkerView

Publish = Callable[[str, str], None]  # (worker id, text or TokenKey)
Amend = Callable[[Decision], Decision]


class Routing:
    def __init__(self, holdings: Holdings, policy: Policy, publish: Publish | None = None) -> None:
        self.holdings = holdings
        self.policy = policy
        self.publish = publish  # replica sync (router/holdings/sync.py), where it is on
        self._reads = policy.reads_holdings
        # A load-only policy's prediction: the request alone, one object rewritten per
        # request (the policy reads it only inside `select`).
        self._bare = Prediction(RouteRequest(""), "", 0, False, [])

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerView], now: float,
        amend: Amend | None = None,
    ) -> Decision:  # fmt: skip
        """The policy's decision, or what `amend` makes of it (a `prompt_cache_key`
        session's worker, router/holdings/sessions.py), recorded in the room and published."""
        holdings = self.holdings
        if not self._reads:
            bare = self._bare
            bare.request = request
            decision = self.policy.select(bare, workers, now)
            if amend is not None:
                decision = amend(decision)
            if self.publish is not None:
                key = holdings.routing_key(request)
                self.publish(decision.worker_id, key)
            return decision
        prediction = holdings.predict(request, workers, now)
        decision = self.policy.select(prediction, workers, now)
        if amend is not None:
            decision = amend(decision)
        holdings.routed(prediction, decision.worker_id, now)
        if self.publish is not None:
            self.publish(decision.worker_id, prediction.key)
        return decision

    def observe(self, worker_id: str, key: str, now: float) -> None:
        """Another replica's decision (router/holdings/sync.py), for the room where the
        policy reads holdings (a load-only policy kept no tree before the room either)."""
        if self._reads:
            self.holdings.observe(worker_id, key, now)
