"""Pins: a session's prefix held in the radix cache across a tool gap.

An agent's next call arrives after a tool runs (seconds to minutes). Plain LRU evicts the
session's prefix in that gap when the worker is busy, and the next call prefills it all
again. A request that asks for it (``cache_pin_ttl`` seconds, or the worker's default for
requests with a ``prompt_cache_key``) leaves its whole sequence (prompt + answer) pinned
when it finishes:

- A pin is one more lock on the sequence's tree path (``RadixCache.lock``): eviction
  skips it in both tiers, exactly as it skips a running request's prefix.
- TTL: the request's, clamped to ``max_ttl`` (the answer's usage reports the clamp).
  A pin is released when its TTL passes, or when the session's next call (same key) is
  admitted: that call's own lock then holds the path, and its own answer pins anew.
- Budget: pins hold at most ``budget`` tokens (``pin_budget`` × KV capacity; a shared
  prefix counts once per pin that holds it, so the bound is conservative). A new pin
  past it releases the oldest pins first.
- Moved: the router moved the session to another worker (its worker overloaded or
  gone, or its context lost: router/holdings/sessions.py) and says so (``POST
  /release_pin``): the pin would only hold KV for a call that goes elsewhere.
- Memory pressure: when a request cannot be admitted even after evicting every unpinned
  token, the scheduler releases the oldest pins (``relieve``) before it preempts or
  waits; with a host tier the released prefix is then evicted *to the host* (write-back),
  so it is moved to the host tier before it is dropped. Pins never starve other traffic.

Keys are the session's (one pin per key: a new answer replaces the session's older pin):
the router's ``x-radix-pin-key`` header where it sends one (its tenant's session: two
tenants may pick one ``prompt_cache_key``, and one's calls must not release the other's
pin; worker/http/intake.py ``pin_key``), else the ``prompt_cache_key`` itself, or the
request id for a pin without a key.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine.prefix_cache import PrefixCache
from worker.engine.tree_node import TreeNode


@dataclass(eq=False)
class Pin:
    key: str
    node: TreeNode
    tokens: int  # the pinned path's length
    expires_at: float


class PinTable:
    def __init__(
        self, cache: PrefixCache, budget: int, max_ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.cache = cache
        self.budget = budget
        self.max_ttl = max_ttl
        self.clock = clock
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # oldest first
        self._expiry: list[tuple[float, int, Pin]] = []  # lazily cleaned heap
        self._seq = 0
        self.pinned_tokens = 0
        self.released = {"expired": 0, "next_call": 0, "budget": 0, "pressure": 0, "moved": 0}
        self.clamped = 0

    def __len__(self) -> int:
        return len(self._pins)

    def grant(self, ttl: float) -> tuple[float, bool]:
        """(the TTL granted, whether it was clamped to max_ttl)."""
        if ttl > self.max_ttl:
            self.clamped += 1
            return self.max_ttl, True
        return ttl, False

    def pin(self, key: str, tokens: list[int], ttl: float) -> int:
        """Pin the cached prefix of `tokens` (just inserted by the scheduler) for `ttl`
        seconds; the tokens pinned (0: nothing cached, no TTL, or over the budget)."""
        self.release(key, "next_call")
        if ttl <= 0 or self.budget <= 0:
            return 0
        match = self.cache.match_prefix(tokens, record=False)
        n = match.prefix_len + match.host_len  # the whole path the lock holds
        if n == 0 or n > self.budget:
            return 0
        while self.pinned_tokens + n > self.budget:
            oldest = next(iter(self._pins))
            self.release(oldest, "budget")
        self.cache.lock(match.last_node)
        pin = Pin(key, match.last_node, n, self.clock() + ttl)
        self._pins[key] = pin
        self._seq += 1
        heapq.heappush(self._expiry, (pin.expires_at, self._seq, pin))
        self.pinned_tokens += n
        return n

    def release(self, key: str, why: str) -> bool:
        pin = self._pins.pop(key, None)
        if pin is None:
            return False
        self.cache.unlock(pin.node)
        self.pinned_tokens -= pin.tokens
        self.released[why] += 1
        return True

    def expire(self) -> int:
        """Release every pin whose TTL has passed; how many."""
        now, heap, n = self.clock(), self._expiry, 0
        while heap and heap[0][0] <= now:
            _, _, pin = heapq.heappop(heap)
            if self._pins.get(pin.key) is pin:
                self.release(pin.key, "expired")
                n += 1
        if len(heap) > 2 * len(self._pins) + 64:  # replaced pins' entries piled up
            self._expiry = [e for e in heap if self._pins.get(e[2].key) is e[2]]
            heapq.heapify(self._expiry)
        return n

    def relieve(self, needed: int) -> int:
        """Memory pressure: release the oldest pins until `needed` device tokens could
        be evicted (or none is left); how many were released."""
        n = 0
        while self._pins and self.cache.evictable_size < needed:
            self.release(next(iter(self._pins)), "pressure")
            n += 1
        return n

    def locked_nodes(self) -> list[TreeNode]:
        """The node each pin locks (check_integrity counts them with the requests')."""
        return [pin.node for pin in self._pins.values()]

    def check(self) -> None:
        """Each pin holds an attached, locked path of its length; the sum is kept."""
        total = 0
        for key, pin in self._pins.items():
            assert pin.key == key, f"pin {key!r} filed under another key"
            node, depth = pin.node, 0
            while node.parent is not None:
                assert node.lock_ref > 0, f"pin {key!r}: an unlocked node on its path"
                depth += len(node)
                node = node.parent
            assert node is self.cache.root, f"pin {key!r}: its node left the tree"
            assert depth == pin.tokens, f"pin {key!r}: path {depth} != {pin.tokens} tokens"
            total += pin.tokens
        assert total == self.pinned_tokens, f"pinned {self.pinned_tokens} != sum {total}"
        assert total <= max(self.budget, 0), f"pins hold {total} > budget {self.budget}"
