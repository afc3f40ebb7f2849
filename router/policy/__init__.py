"""Routing policies: pick one worker per request.

``base`` holds what every policy is (``Policy``, its input ``RouteRequest`` /
``WorkerView`` / ``FleetView``, its output ``Decision``);
``cache_aware`` the default rule, documented with every threshold at the top of its
module; ``cost_aware`` the least predicted time to first token over the same trees;
``simple`` the load-only baselines. ``build_policy`` is the one place a name becomes a policy.
"""

from __future__ import annotations

import random

from router.policy.base import Policy
from router.policy.cache_aware import CacheAware
from router.policy.cost_aware import CostAware
from router.policy.simple import ConsistentHash, LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin
from shared.config import RouterConfig


def build_policy(config: RouterConfig, rng: random.Random | None = None) -> Policy:
    """The policy ``config.policy`` names, with its randomness from ``rng``."""
    rng = rng if rng is not None else random.Random()
    name = config.policy
    if name == "cache_aware":
        return CacheAware(config, rng)
    if name == "cost_aware":
        return CostAware(config, rng)
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
