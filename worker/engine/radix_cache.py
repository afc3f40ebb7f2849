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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.kv_blocks import BlockEvents

_TB = 8  # bytes per token id in a key (int64)


def _empty_slots() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def _as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # a tree's slots must never be edited through a reference
    return a


class TreeNode:
    __slots__ = (
        "bend", "blocks", "children", "heap_tick", "id", "kb", "last_access", "lock_ref",
        "parent", "value",
    )  # fmt: skip

    def __init__(
        self, parent: TreeNode | None, kb: bytes, value: np.ndarray, tick: int, node_id: int
    ):
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.kb = kb  # the key as int64 bytes: compared with one memcmp
        self.value = value  # int64 KV slots, read-only, len == len(key)
        self.lock_ref = 0
        self.last_access = tick
        self.heap_tick = -1  # last_access when its live LRU heap entry was pushed; -1: none
        self.id = node_id  # tie-break in the LRU heap (ticks repeat along a path)
        self.blocks: tuple[int, ...] = ()  # KV-event block hashes ending here (kv_blocks.py)
        self.bend = 0  # offset of the first block boundary in this node (kv_blocks.py)

    @property
    def key(self) -> np.ndarray:
        """The node's token ids (a read-only int64 view of `kb`)."""
        return np.frombuffer(self.kb, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key={self.key.tolist()[:8]}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    slots: np.ndarray  # int64 slot indices of the matched prefix, len == prefix_len
    last_node: TreeNode  # deepest matched node (the root when nothing matched)
    prefix_len: int  # always a multiple of page_size


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache: RadixCache or NoCache."""

    allocator: SlotAllocator
    page_size: int
    hit_tokens: int
    miss_tokens: int

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult: ...
    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int: ...
    def lock(self, node: TreeNode) -> None: ...
    def unlock(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def reset(self) -> None: ...
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    def cached_slots(self) -> np.ndarray: ...
    def check_integrity(self) -> None: ...


class RadixCache:
    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._kbytes = page_size * _TB  # bytes of the first page: the child key
        self._ids = itertools.count(1)
        self._tick = 0
        self.root = TreeNode(None, b"", _frozen(_empty_slots()), 0, 0)
        self._leaves: set[TreeNode] = set()  # childless non-root nodes, locked or not
        self._heap: list[tuple[int, int, TreeNode]] = []  # LRU of leaves, lazily updated
        self._evictable = 0
        self._protected = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.kv_events: BlockEvents | None = None  # the one hook: publish_events()

    def publish_events(self, events: BlockEvents) -> None:
        """Report every block stored and removed from now on (call on an empty tree)."""
        if self.root.children:
            raise RuntimeError("KV events must be on from the start (the tree is not empty)")
        events.root = self.root
        self.kv_events = events

    # ---- lookup -------------------------------------------------------------------
    def _walk(
        self, arr: np.ndarray, limit: int, tick: int
    ) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Follow `arr[:limit]` (page-aligned) down the tree, touching every node passed.

        Returns the deepest node, the matched length and the slot runs. A match ending
        inside a node splits it there, so the returned node covers exactly the prefix.
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
                parts.append(child.value)
                node = child
                pos_b += len(kb)
                continue
            # The match ends inside `child`: find the first differing token (numpy, once).
            pos = pos_b // _TB
            n = min(len(child.value), limit - pos)
            neq = child.key[:n] != arr[pos : pos + n]
            m = int(neq.argmax()) if neq.any() else n
            m -= m % self.page_size  # >= page_size: the first page matched as the dict key
            node = self._split(child, m)
            parts.append(node.value)
            pos_b += m * _TB
            break
        return node, pos_b // _TB, parts

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after m tokens; the new upper node takes its place and its locks."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            parent,
            child.kb[: m * _TB],
            _frozen(child.value[:m].copy()),
            child.last_access,
            next(self._ids),
        )
        upper.lock_ref = child.lock_ref
        child.kb = child.kb[m * _TB :]
        child.value = _frozen(child.value[m:].copy())  # copies, so no view pins a freed base
        child.parent = upper
        parent.children[upper.kb[: self._kbytes]] = upper
        upper.children[child.kb[: self._kbytes]] = child
        if self.kv_events is not None:
            self.kv_events.split(upper, child, m)
        return upper

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult:
        """The longest cached page-aligned prefix of `tokens`, its slots and its last node.

        `record=False` for the scheduler's own look-ups (queue ordering, the match after
        an in-flight insert): they count in neither hit_tokens nor miss_tokens."""
        arr = _as_tokens(tokens)
        n = len(arr)
        self._tick += 1
        node, matched, parts = self._walk(arr, n - n % self.page_size, self._tick)
        if record:
            self.hit_tokens += matched
            self.miss_tokens += n - matched
        slots = np.concatenate(parts) if parts else _empty_slots()
        return MatchResult(slots, node, matched)

    # ---- insert -------------------------------------------------------------------
    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int:
        """Cache `tokens` with their KV `slots`; returns how many leading tokens were cached already.

        The caller matched (and locked) `cached_len` tokens and owns the rest of `slots`.
        The cache takes ownership of all of them; the one place a request's slots are
        sliced (`matched` = what the tree holds now, `limit` = page-aligned length):

            0 ........ cached_len ........ matched ........ limit ...... len(tokens)
            | tree's own (locked) | dup: freed  |  stored as new leaf | tail: freed |
        """
        arr = _as_tokens(tokens)
        slots = np.asarray(slots, dtype=np.int64)
        n = len(arr)
        if len(slots) != n:
            raise ValueError(f"{len(slots)} slots for {n} tokens")
        if not 0 <= cached_len <= n:
            raise ValueError(f"cached_len {cached_len} out of range [0, {n}]")
        limit = n - n % self.page_size
        self._tick += 1
        node, matched, _ = self._walk(arr, limit, self._tick)
        if matched < cached_len:
            raise ValueError(
                f"cached_len {cached_len} exceeds the cached prefix ({matched} tokens): "
                "the matched path must stay locked until insert"
            )
        if matched < limit:
            kb = arr[matched:limit].tobytes()
            leaf = TreeNode(
                node, kb, _frozen(slots[matched:limit].copy()), self._tick, next(self._ids)
            )
            node.children[kb[: self._kbytes]] = leaf
            self._leaves.discard(node)
            node.heap_tick = -1  # no longer a leaf: its heap entry, if any, is dead
            self._leaves.add(leaf)
            self._push(leaf)
            self._evictable += limit - matched
            if self.kv_events is not None:
                self.kv_events.stored(leaf, arr, matched, limit)
        if matched > cached_len:
            self.allocator.free(slots[cached_len:matched])
        tail = max(limit, cached_len)
        if n > tail:
            self.allocator.free(slots[tail:])
        return matched

    # ---- locks and eviction -------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors (root excluded) from eviction."""
        moved = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                moved += len(node.value)
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
            if node.lock_ref == 0:
                moved += len(node.value)
            node = node.parent
        self._evictable += moved
        self._protected -= moved

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` (when that many are unlocked) from the LRU leaves up."""
        if num_tokens <= 0:
            return 0
        if len(self._heap) > 2 * len(self._leaves) + 1024:
            self._rebuild_heap()  # too many dead entries piled up
        heap, root, kbytes, events = self._heap, self.root, self._kbytes, self.kv_events
        freed = 0
        runs: list[np.ndarray] = []
        locked: list[tuple[int, int, TreeNode]] = []
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            tick, _, node = entry
            if tick != node.heap_tick:
                continue  # dead: superseded, or the node gained a child or was evicted
            if node.last_access != tick:  # used since pushed: requeue at its true time
                self._push(node)
                continue
            if node.lock_ref:
                locked.append(entry)  # still a valid leaf: back in once we are done
                continue
            node.heap_tick = -1
            if events is not None:
                events.removed(node)
            runs.append(node.value)
            freed += len(node.value)
            parent = node.parent
            assert parent is not None
            del parent.children[node.kb[:kbytes]]
            self._leaves.discard(node)
            node.parent = None
            if parent is not root and not parent.children:
                self._leaves.add(parent)
                self._push(parent)
        for entry in locked:
            heapq.heappush(heap, entry)
        if runs:
            self.allocator.free(np.concatenate(runs))
        self._evictable -= freed
        return freed

    def _push(self, node: TreeNode) -> None:
        node.heap_tick = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.id, node))

    def _rebuild_heap(self) -> None:
        for node in self._leaves:
            node.heap_tick = node.last_access
        self._heap = [(n.last_access, n.id, n) for n in self._leaves]
        heapq.heapify(self._heap)

    def reset(self) -> None:
        """Drop every unlocked entry and free its slots (flush_cache); locked paths stay."""
        self.evict(self._evictable)

    # ---- sizes and checks ---------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_slots(self) -> np.ndarray:
        """Every slot the tree holds."""
        runs = [node.value for node in self._nodes()]
        return np.concatenate(runs) if runs else _empty_slots()

    def check_integrity(self) -> None:
        """Assert the tree's invariants (AssertionError naming the first one broken)."""
        nodes = self._nodes()
        evictable = protected = 0
        for node in nodes:
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            assert parent.children.get(node.kb[: self._kbytes]) is node, f"{node!r} misfiled"
            assert len(node.kb) == len(node.value) * _TB > 0, f"{node!r} key/slots mismatch"
            assert len(node.value) % self.page_size == 0, f"{node!r} not page-aligned"
            assert not node.value.flags.writeable, f"{node!r} slots writable"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, f"{node!r} lock_ref below its children's"
            assert (node in self._leaves) == (not node.children), f"{node!r} leaf set wrong"
            if node.lock_ref > 0:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        assert len(self._leaves) == sum(1 for n in nodes if not n.children), "stale leaves"
        entries = {(tick, node.id) for tick, _, node in self._heap}
        for leaf in self._leaves:  # every leaf has a live entry no later than its last use
            assert (leaf.heap_tick, leaf.id) in entries, f"{leaf!r} missing from the LRU heap"
            assert 0 <= leaf.heap_tick <= leaf.last_access, f"{leaf!r} heap entry from the future"
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes {(self._evictable, self._protected)} != tree {(evictable, protected)}"
        )
        slots = self.cached_slots()
        if len(slots):
            assert slots.min() >= 0 and slots.max() < self.allocator.capacity, "slot out of range"
            assert np.bincount(slots).max() == 1, "a slot is cached twice"


class NoCache:
    """The same interface caching nothing: the correctness baseline and the ablation switch."""

    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode(None, b"", _frozen(_empty_slots()), 0, 0)
        self.hit_tokens = 0
        self.miss_tokens = 0

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult:
        if record:
            self.miss_tokens += len(tokens)
        return MatchResult(_empty_slots(), self.root, 0)

    def insert(
        self, tokens: Sequence[int] | np.ndarray, slots: np.ndarray, cached_len: int = 0
    ) -> int:
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots for {len(tokens)} tokens")
        if cached_len != 0:
            raise ValueError("NoCache holds nothing, so cached_len must be 0")
        self.allocator.free(np.asarray(slots, dtype=np.int64))
        return 0

    def lock(self, node: TreeNode) -> None:
        pass  # only the root exists, and the root is never locked

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    @property
    def total_size(self) -> int:
        return 0

    def cached_slots(self) -> np.ndarray:
        return _empty_slots()

    def check_integrity(self) -> None:
        assert not self.root.children, "NoCache holds entries"
