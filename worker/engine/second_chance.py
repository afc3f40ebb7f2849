"""The radix cache's second chance for reused prefixes (worker/engine/radix_cache.py):
one rule, capped and aged.

A node matched by an admission (`match_prefix` with `record`) is marked reused. When a
reused leaf reaches the head of the LRU it is requeued once instead of evicted, at the
midpoint between its last use and now: it gains half its idle time, so a prefix a later
request came back for outlives one-off prompts, while what was used after that midpoint
stays ahead of it. Granted nodes hold at most `cap` device tokens together; a reused
leaf past the cap is evicted as plain LRU would (cap 0: plain LRU, nothing is marked).
A granted node leaves the count when an admission matches it again (reused anew) or it
leaves the device. Requeued as the newest instead, every reused agent context went
ahead of prompts used seconds before and a shared-prefix neighbour lost its system
prompts (3-6 points), with a cap of 2% of KV as well (loadtests/results/agents.md).
"""

from __future__ import annotations

from worker.engine.tree_node import GRANTED, REUSED, TreeNode


class SecondChance:
    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError(f"second_chance_tokens must be >= 0, got {cap}")
        self.cap = cap  # device tokens granted nodes may hold together
        self.granted = 0  # device tokens of the nodes holding a granted second chance

    def reuse(self, node: TreeNode) -> None:
        """An admission matched `node`: it may have a second chance (again)."""
        if node.chance == GRANTED:
            self.granted -= len(node)
        node.chance = REUSED

    def grant(self, node: TreeNode, now: int) -> bool:
        """`node`, unlocked, heads the LRU at tick `now`: True when it is to be requeued
        (its `last_access` aged to the midpoint), False when it is to be evicted."""
        if node.chance != REUSED or self.granted + len(node) > self.cap:
            return False
        node.chance = GRANTED
        self.granted += len(node)
        node.last_access = (node.last_access + now) // 2 + 1  # after its last use, <= now
        return True

    def left(self, node: TreeNode) -> None:
        """`node` left the device: out of the count, unmarked."""
        if node.chance == GRANTED:
            self.granted -= len(node)
        node.chance = 0

    def check(self, nodes: list[TreeNode]) -> None:
        granted = sum(len(n) for n in nodes if n.chance == GRANTED)
        assert granted == self.granted, f"granted {self.granted} != {granted}"
        assert granted <= self.cap, f"second chances over the cap: {granted} > {self.cap}"
