"""RadixCache: a token-level radix tree over KV slots (RadixAttention, as in SGLang).

Each node holds a run of token ids (`key`) and the KV slots that hold their K/V
(`value`). A worked example, page_size 1, after inserting [1 2 3 4] then [1 2 5]:

    root ─ [1 2] ─┬─ [3 4]        children keyed by first token (first page when
                  └─ [5]          page_size > 1); [1 2] was split where they diverged

Hot path design: a request's tokens are turned into bytes once, and every node's key
is compared as one bytes slice (a memcmp), never token by token in Python; numpy
finds the first mismatch only in the one node where a match ends. LRU uses a tick
counter (deterministic, no clock).

Eviction keeps one heap of leaves across calls, keyed (last_access, id), updated
lazily: a match only bumps `last_access`, and an entry found stale when popped is
pushed back at the node's true time. Ticks only grow, so every entry is <= its node's
true key and the first valid entry popped is the true LRU leaf. A node records the
tick of its live entry (`heap_tick`, -1 for none), which retires superseded entries
and those of nodes that gained a child or were evicted. So an eviction costs
O((evicted + touched since last time) log n), not a pass over every leaf (SGLang
walks the whole tree to collect leaves on each call).

Eviction gives a reused prefix one aged second chance, capped (`second_chance_tokens`):
the rule is stated in second_chance.py.

The host tier is a subclass filling this class's hooks (`_evict_leaf`, `_set_host`, ...):
`HiRadixCache` in hiradix_cache.py, as SGLang keeps its own. Every change of a node's
residency goes through `_retier`, which reports it to the KV event hook (kv_blocks.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.kv_blocks import BlockEvents
from worker.engine.second_chance import SecondChance
from worker.engine.tree_check import check_tree
from worker.engine.tree_node import TOKEN_BYTES as _TB
from worker.engine.tree_node import (
    MatchResult,
    TreeNode,
    as_tokens,
    empty_slots,
    frozen,
)
from worker.engine.types import KVCopies

KEEP: Any = object()  # `_retier`: leave this tier as it is


class RadixCache:
    """The tree over the device pool. Device residency is closed upwards (a device
    node's parent is one), since the LRU evicts device leaves only."""

    def __init__(
        self, allocator: SlotAllocator, page_size: int = 1, second_chance_tokens: int = 0
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.second_chance = SecondChance(second_chance_tokens)
        self.allocator = allocator
        self.page_size = page_size
        self._kbytes = page_size * _TB  # bytes of the first page: the child key
        self._ids = itertools.count(1)
        self._tick = 0
        self.root = TreeNode(None, b"", frozen(empty_slots()), 0, 0)
        self._leaves: set[TreeNode] = set()  # device leaves (no device child), locked or not
        self._heap: list[tuple[int, int, TreeNode]] = []  # LRU of leaves, lazily updated
        self._evictable = 0  # device tokens, unlocked
        self._protected = 0  # device tokens, locked
        self.hit_tokens = 0  # device hits
        self.host_hit_tokens = 0  # matched in the host tier (HiRadixCache)
        self.miss_tokens = 0
        self.kv_events: BlockEvents | None = None  # the one hook: publish_events()

    def publish_events(self, events: BlockEvents) -> None:
        """Report every block stored and removed from now on (call on an empty tree),
        each with its tier's medium: a demotion to the host tier is stored on the host
        then removed from the device; a load back, stored on the device."""
        if self.root.children:
            raise RuntimeError("KV events must be on from the start (the tree is not empty)")
        events.root = self.root
        self.kv_events = events

    # ---- lookup -------------------------------------------------------------------
    def _walk(
        self, arr: np.ndarray, limit: int, tick: int, reuse: bool = False
    ) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Follow `arr[:limit]` (page-aligned) down the tree, touching every node passed
        (and marking it reused when `reuse`: an admission's match, the second chance).

        Returns the deepest node, the matched length and the device slot runs (the
        host-only nodes of the path, always its tail, give none). A match ending inside
        a node splits it there, so the returned node covers exactly the prefix.
        """
        tb = arr.tobytes()
        kbytes = self._kbytes
        end_b = limit * _TB
        node = self.root
        parts: list[np.ndarray] = []
        pos_b = 0
        while pos_b < end_b:
            child = node.children.get(tb[pos_b : pos_b + kbytes])
            if child is None:
                break
            kb = child.kb
            child.last_access = tick
            # startswith is one memcmp with no copy (memoryview == compares item by item)
            if tb.startswith(kb, pos_b, end_b):
                if reuse:
                    self.second_chance.reuse(child)
                if child.value is not None:
                    parts.append(child.value)
                node = child
                pos_b += len(kb)
                continue
            # The match ends inside `child`: find the first differing token (numpy, once).
            pos = pos_b // _TB
            n = min(len(child), limit - pos)
            neq = child.key[:n] != arr[pos : pos + n]
            m = int(neq.argmax()) if neq.any() else n
            m -= m % self.page_size  # >= page_size: the first page matched as the dict key
            node = self._split(child, m)
            if reuse:
                self.second_chance.reuse(node)
            if node.value is not None:
                parts.append(node.value)
            pos_b += m * _TB
            break
        return node, pos_b // _TB, parts

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after m tokens; the new upper node takes its place, its locks and
        its tiers (both halves are resident where `child` was)."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(parent, child.kb[: m * _TB], None, child.last_access, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.chance = child.chance  # a granted node's tokens stay counted, split in two
        child.kb = child.kb[m * _TB :]
        if child.value is not None:
            upper.value = frozen(child.value[:m].copy())
            child.value = frozen(child.value[m:].copy())  # copies: no view pins a freed base
            upper.dev_children = 1
        self._split_host(upper, child, m)
        child.parent = upper
        parent.children[upper.kb[: self._kbytes]] = upper
        upper.children[child.kb[: self._kbytes]] = child
        if self.kv_events is not None:
            self.kv_events.split(upper, child, m)
        return upper

    def _split_host(self, upper: TreeNode, child: TreeNode, m: int) -> None:
        """The host tier's part of a split (HiRadixCache); the device tier has none."""

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult:
        """The longest cached page-aligned prefix of `tokens` (device, then host tokens),
        its device slots and its last node.

        `record=False` for the scheduler's own look-ups (queue ordering, the match after
        an in-flight insert): they count in neither hit_tokens nor miss_tokens."""
        arr = as_tokens(tokens)
        n = len(arr)
        self._tick += 1
        reuse = record and self.second_chance.cap > 0
        node, matched, parts = self._walk(arr, n - n % self.page_size, self._tick, reuse)
        slots = np.concatenate(parts) if parts else empty_slots()
        on_device = len(slots)
        if record:
            self.hit_tokens += on_device
            self.host_hit_tokens += matched - on_device
            self.miss_tokens += n - matched
        return MatchResult(slots, node, on_device, matched - on_device)

    # ---- insert -------------------------------------------------------------------
    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int:
        """Cache `tokens` with their KV `slots`; returns how many leading tokens were cached already.

        The caller matched (and locked) `cached_len` tokens and owns the rest of `slots`.
        The cache takes ownership of all of them; the one place a request's slots are
        sliced (`matched` = what the tree holds now in either tier, `on_device` = the
        part of it on the device, `limit` = page-aligned length):

            0 ..... cached_len ..... on_device ..... matched ..... limit ..... len(tokens)
            | tree's own (locked) | dup: freed | host-only nodes: | new leaf | tail: freed |
                                               | take these slots |
        """
        arr = as_tokens(tokens)
        slots = np.asarray(slots, dtype=np.int64)
        n = len(arr)
        if len(slots) != n:
            raise ValueError(f"{len(slots)} slots for {n} tokens")
        if not 0 <= cached_len <= n:
            raise ValueError(f"cached_len {cached_len} out of range [0, {n}]")
        limit = n - n % self.page_size
        self._tick += 1
        node, matched, parts = self._walk(arr, limit, self._tick)
        on_device = sum(len(p) for p in parts)
        if on_device < cached_len:
            raise ValueError(
                f"cached_len {cached_len} exceeds the cached prefix ({on_device} tokens on "
                "the device): the matched path must stay locked until insert"
            )
        if on_device < matched:  # host-resident nodes on the path (HiRadixCache)
            self._revive(node, slots, on_device)
        if matched < limit:
            kb = arr[matched:limit].tobytes()
            leaf = TreeNode(node, kb, None, self._tick, next(self._ids))
            node.children[kb[: self._kbytes]] = leaf
            self._retier(leaf, device=frozen(slots[matched:limit].copy()))
            if self.kv_events is not None:
                self.kv_events.stored(leaf, arr, matched, limit)
            self._inserted(leaf)
        if on_device > cached_len:
            self.allocator.free(slots[cached_len:on_device])
        tail = max(limit, cached_len)
        if n > tail:
            self.allocator.free(slots[tail:])
        return matched

    def _inserted(self, leaf: TreeNode) -> None:
        """A new leaf entered the tree (HiRadixCache: write-through copies it)."""

    def _revive(self, node: TreeNode, slots: np.ndarray, start: int) -> None:
        raise AssertionError("a match ran past the device tier without a host tier")

    def load(self, node: TreeNode) -> np.ndarray:
        """Device slots for the host-resident tail of a match: none without a host tier."""
        return empty_slots()

    def take_copies(self) -> KVCopies | None:
        """This step's host copies (HiRadixCache): none without a host tier."""
        return None

    # ---- tiers --------------------------------------------------------------------
    def _retier(self, node: TreeNode, device: Any = KEEP, host: Any = KEEP) -> None:
        """The one place a node's residency changes (new slots, or None: gone from that
        tier): sizes, the device-leaf set and both LRU heaps follow. Callers free or
        hand over the slots; a node with neither tier left is detached (`_remove`)."""
        parent = node.parent
        assert parent is not None
        was_device, was_host = node.value is not None, node.host_value is not None
        if device is not KEEP and (device is None) != (node.value is None):
            n = len(node)
            if device is None:  # off the device
                parent.dev_children -= 1
                self._leaves.discard(node)
                node.heap_tick = -1
                self.second_chance.left(node)
                if parent is not self.root and parent.value is not None and not parent.dev_children:
                    self._leaves.add(parent)
                    self._push(parent)
                n = -n
            else:  # onto the device
                parent.dev_children += 1
                if parent in self._leaves:
                    self._leaves.discard(parent)
                    parent.heap_tick = -1
                if node.dev_children == 0:
                    self._leaves.add(node)
            if node.lock_ref:
                self._protected += n
            else:
                self._evictable += n
        if device is not KEEP:
            node.value = device
            if device is not None and node in self._leaves:
                self._push(node)
        if host is not KEEP or device is not KEEP:
            self._set_host(node, host)
        if self.kv_events is not None:  # after both tiers are set: a republish sees them
            moved_device = device is not KEEP and (device is None) == was_device
            moved_host = host is not KEEP and (host is None) == was_host
            if moved_device or moved_host:
                self.kv_events.retiered(
                    node,
                    (device is not None) if moved_device else None,
                    (host is not None) if moved_host else None,
                )

    def _set_host(self, node: TreeNode, host: Any) -> None:
        """The host tier's part of `_retier` (`host`: new host slots, None, or `KEEP`
        when only the device tier moved); HiRadixCache keeps its set and LRU here."""
        assert host is KEEP or host is None, "host KV without a host tier"

    def _remove(self, node: TreeNode) -> None:
        """Detach a node held in no tier any more (slots already freed by the caller)."""
        parent = node.parent
        assert parent is not None and not node.children
        self._retier(node, device=None, host=None)  # reports its blocks removed per tier
        del parent.children[node.kb[: self._kbytes]]
        node.parent = None

    @staticmethod
    def _subtree(node: TreeNode) -> list[TreeNode]:
        """`node` and every node below it, each after its parent."""
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        return order

    def _drop_subtree(self, node: TreeNode) -> list[np.ndarray]:
        """Remove `node` (unlocked, so is all below it) and everything below it; returns
        their device slots for the caller to free."""
        order = self._subtree(node)
        runs = [n.value for n in order if n.value is not None]
        for n in reversed(order):  # leaves first
            self._remove(n)
        return runs

    # ---- locks and eviction -------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors (root excluded) from eviction in either tier."""
        moved = 0
        while node.parent is not None:
            if node.lock_ref == 0 and node.value is not None:
                moved += len(node)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= moved
        self._protected += moved

    def unlock(self, node: TreeNode) -> None:
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        moved = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.value is not None:
                moved += len(node)
            node = node.parent
        self._evictable += moved
        self._protected -= moved

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots (when that many are unlocked) from the
        LRU device leaves up (`_evict_leaf`: with a host tier they stay cached there)."""
        if num_tokens <= 0:
            return 0
        if len(self._heap) > 2 * len(self._leaves) + 1024:
            self._rebuild_heap()  # too many dead entries piled up
        heap = self._heap
        freed = 0
        runs: list[np.ndarray] = []
        locked: list[tuple[int, int, TreeNode]] = []
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            tick, _, node = entry
            if tick != node.heap_tick:
                continue  # dead: superseded, or the node gained a device child or left
            if node.last_access != tick:  # used since pushed: requeue at its true time
                self._push(node)
                continue
            if node.lock_ref:
                locked.append(entry)  # still a valid leaf: back in once we are done
                continue
            if self.second_chance.grant(node, self._tick + 1):
                self._tick += 1  # requeued at its aged time (second_chance.py)
                self._push(node)
                continue
            assert node.value is not None
            freed += len(node)
            runs.extend(self._evict_leaf(node))
        for entry in locked:
            heapq.heappush(heap, entry)
        if runs:
            self.allocator.free(np.concatenate(runs))
        return freed

    def _evict_leaf(self, node: TreeNode) -> list[np.ndarray]:
        """Take an unlocked device leaf off the device; its device slots, to free."""
        return self._drop_subtree(node)

    def _push(self, node: TreeNode) -> None:
        node.heap_tick = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _rebuild_heap(self) -> None:
        for node in self._leaves:
            node.heap_tick = node.last_access
        self._heap = [(n.last_access, n.id, n) for n in self._leaves]
        heapq.heapify(self._heap)

    def reset(self) -> None:
        """Drop every unlocked entry (flush_cache); locked paths stay on the device."""
        dev_runs: list[np.ndarray] = []
        for node in self._nodes():  # parents before children
            if node.parent is None:
                continue  # under a subtree dropped already
            self._reset_host(node)
            if node.lock_ref == 0:
                dev_runs.extend(self._drop_subtree(node))
        if dev_runs:
            self.allocator.free(np.concatenate(dev_runs))
        self._rebuild_heap()

    def _reset_host(self, node: TreeNode) -> None:
        """`reset`'s host part for one node, before its subtree goes (HiRadixCache)."""

    # ---- sizes and checks ---------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        """Device tokens cached."""
        return self._evictable + self._protected

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root, each after its parent."""
        return self._subtree(self.root)[1:]

    def cached_slots(self) -> np.ndarray:
        """Every device slot the tree holds."""
        runs = [node.value for node in self._nodes() if node.value is not None]
        return np.concatenate(runs) if runs else empty_slots()

    def check_integrity(self) -> None:
        """Assert the tree's invariants (worker/engine/tree_check.py); `_check_node`
        adds the host tier's."""
        check_tree(self)

    def _check_node(self, node: TreeNode) -> None:
        assert node.value is not None and node.host_value is None, f"{node!r} off the device"
