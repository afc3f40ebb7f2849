"""Routing policies: pick one worker per request, from the holdings room's prediction
and the loads.

``base`` holds what every policy is (``Policy``, its output ``Decision``); ``cache_aware``
the default rule, documented with every threshold at the top of its module;
``cost_aware`` the least predicted time to first token; ``simple`` the load-only
baselines. ``build_policy`` is the one place a name becomes a policy; ``build_routing``
joins it to a holdings room of its own (router/routing.py).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from router.holdings.merge import BlockHolders
from router.holdings.room import Holdings
from router.policy.base import Policy
from router.policy.cache_aware import CacheAware
from router.policy.cost_aware import CostAware
from router.policy.simple import ConsistentHash, LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin
from shared.config import RouterConfig

if TYPE_CHECKING:
    from router.routing import Publish, Routing


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


def build_routing(
    config: RouterConfig, rng: random.Random | None = None, *, feed: BlockHolders | None = None,
    publish: Publish | None = None,
) -> Routing:  # fmt: skip
    """A holdings room (with the KV-event index `feed`, where given) and the policy
    `config.policy` names, joined."""
    # Here, not at the top: router.routing imports router.policy.base, which runs this
    # package first.
    from router.routing import Routing

    return Routing(Holdings(config, feed), build_policy(config, rng), publish)
