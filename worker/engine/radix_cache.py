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

Host tier (optional, `host=HostTier(...)`, SGLang's HiCache idea): a node's KV may sit
on the device (`value`), in host memory (`host_value`), or both. The device LRU above
evicts device leaves; with a host tier an evicted leaf keeps its node, written back to
host slots first unless it has a copy there (write-through makes one at insert). A
match may run on into host-only nodes (`MatchResult.host_len`); `load` gives them
device slots and plans the copies. The host pool has its own lazy LRU heap (the same
scheme), which drops host copies, and host-only leaves with them, when it needs room.
Every change of a node's residency goes through `_retier`, which reports it to the KV
event hook (kv_blocks.py: stored / removed, with its tier's medium).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.host_tier import HostTier, KVCopies
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
        "bend", "blocks", "children", "copy_epoch", "dev_children", "heap_tick", "host_tick",
        "host_value", "id", "kb", "last_access", "lock_ref", "parent", "value",
    )  # fmt: skip

    def __init__(
        self, parent: TreeNode | None, kb: bytes, value: np.ndarray | None, tick: int, node_id: int
    ):
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.kb = kb  # the key as int64 bytes: compared with one memcmp
        # Device KV slots (int64, read-only, one per token), None while host-resident only.
        self.value = value
        self.host_value: np.ndarray | None = None  # host KV slots: a host-resident copy
        self.dev_children = 0  # children with device slots (a device leaf has none)
        self.lock_ref = 0
        self.last_access = tick
        self.heap_tick = -1  # last_access when its live LRU heap entry was pushed; -1: none
        self.host_tick = -1  # the same for the host LRU heap
        self.copy_epoch = 0  # the host tier's plan that copies this node (see host_tier.py)
        self.id = node_id  # tie-break in the LRU heap (ticks repeat along a path)
        self.blocks: tuple[int, ...] = ()  # KV-event block hashes ending here (kv_blocks.py)
        self.bend = 0  # offset of the first block boundary in this node (kv_blocks.py)

    @property
    def key(self) -> np.ndarray:
        """The node's token ids (a read-only int64 view of `kb`)."""
        return np.frombuffer(self.kb, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.kb) // _TB

    def __repr__(self) -> str:
        tier = "device" if self.value is not None else "host"
        return (
            f"TreeNode(id={self.id}, key={self.key.tolist()[:8]}, lock_ref={self.lock_ref}, "
            f"{tier}{'+host' if tier == 'device' and self.host_value is not None else ''})"
        )


class MatchResult(NamedTuple):
    slots: np.ndarray  # int64 device slots of the matched prefix, len == prefix_len
    last_node: TreeNode  # deepest matched node in either tier (the root when nothing matched)
    prefix_len: int  # device-resident tokens matched; always a multiple of page_size
    # Host-resident tokens matched after them (`RadixCache.load` brings them to the device).
    host_len: int = 0


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
    def load(self, node: TreeNode) -> np.ndarray: ...
    def take_copies(self) -> KVCopies | None: ...
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


_KEEP: Any = object()  # `_retier`: leave this tier as it is


class RadixCache:
    """The tree over the device pool, and over a host pool when `host` is given.

    With a host tier a node is device-resident (`value`), host-resident (`host_value`)
    or both; device residency is closed upwards (a device node's parent is one), since
    the device LRU evicts device leaves only. An evicted device leaf keeps its place in
    the tree as host-resident (written back first unless it holds a host copy already);
    `load` brings a matched host-resident run back. The host pool has its own LRU, which
    drops host copies (and host-only leaves with them) when it needs room.
    """

    def __init__(
        self, allocator: SlotAllocator, page_size: int = 1, host: HostTier | None = None
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.host = host
        self._kbytes = page_size * _TB  # bytes of the first page: the child key
        self._ids = itertools.count(1)
        self._tick = 0
        self.root = TreeNode(None, b"", _frozen(_empty_slots()), 0, 0)
        self._leaves: set[TreeNode] = set()  # device leaves (no device child), locked or not
        self._heap: list[tuple[int, int, TreeNode]] = []  # LRU of leaves, lazily updated
        self._host_nodes: set[TreeNode] = set()  # nodes holding host slots
        self._host_heap: list[tuple[int, int, TreeNode]] = []  # their LRU, lazily updated
        self._evictable = 0  # device tokens, unlocked
        self._protected = 0  # device tokens, locked
        self.hit_tokens = 0  # device hits
        self.host_hit_tokens = 0
        self.miss_tokens = 0
        self.kv_events: BlockEvents | None = None  # the one hook: publish_events()

    def publish_events(self, events: BlockEvents) -> None:
        """Report every block stored and removed from now on (call on an empty tree).

        Each tier's blocks are reported with that tier's medium (`_retier`): a demotion
        is stored on the host then removed from the device, a load back stored on the
        device (the host copy stays), a dropped host copy removed from the host."""
        if self.root.children:
            raise RuntimeError("KV events must be on from the start (the tree is not empty)")
        events.root = self.root
        self.kv_events = events

    # ---- lookup -------------------------------------------------------------------
    def _walk(
        self, arr: np.ndarray, limit: int, tick: int
    ) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Follow `arr[:limit]` (page-aligned) down the tree, touching every node passed.

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
        child.kb = child.kb[m * _TB :]
        if child.value is not None:
            upper.value = _frozen(child.value[:m].copy())
            child.value = _frozen(child.value[m:].copy())  # copies: no view pins a freed base
            upper.dev_children = 1
        if child.host_value is not None:
            upper.host_value = _frozen(child.host_value[:m].copy())
            child.host_value = _frozen(child.host_value[m:].copy())
            upper.copy_epoch = child.copy_epoch
            self._host_nodes.add(upper)
            self._push_host(upper)
        child.parent = upper
        parent.children[upper.kb[: self._kbytes]] = upper
        upper.children[child.kb[: self._kbytes]] = child
        if self.kv_events is not None:
            self.kv_events.split(upper, child, m)
        return upper

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, *, record: bool = True
    ) -> MatchResult:
        """The longest cached page-aligned prefix of `tokens` (device, then host tokens),
        its device slots and its last node.

        `record=False` for the scheduler's own look-ups (queue ordering, the match after
        an in-flight insert): they count in neither hit_tokens nor miss_tokens."""
        arr = _as_tokens(tokens)
        n = len(arr)
        self._tick += 1
        node, matched, parts = self._walk(arr, n - n % self.page_size, self._tick)
        slots = np.concatenate(parts) if parts else _empty_slots()
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
        arr = _as_tokens(tokens)
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
        if on_device < matched:
            self._revive(node, slots, on_device)
        if matched < limit:
            kb = arr[matched:limit].tobytes()
            leaf = TreeNode(node, kb, None, self._tick, next(self._ids))
            node.children[kb[: self._kbytes]] = leaf
            self._retier(leaf, device=_frozen(slots[matched:limit].copy()))
            if self.kv_events is not None:
                self.kv_events.stored(leaf, arr, matched, limit)
            if self.host is not None and self.host.write_through:
                self._write_back(leaf)
        if on_device > cached_len:
            self.allocator.free(slots[cached_len:on_device])
        tail = max(limit, cached_len)
        if n > tail:
            self.allocator.free(slots[tail:])
        return matched

    def _revive(self, node: TreeNode, slots: np.ndarray, start: int) -> None:
        """The host-only tail of the path ending at `node` (tokens [start, ...)) takes the
        caller's device slots for the same tokens: the same K/V, nothing to copy."""
        path = self._host_only_path(node)
        pos = start
        for p in path:
            self._retier(p, device=_frozen(slots[pos : pos + len(p)].copy()))
            pos += len(p)

    @staticmethod
    def _host_only_path(node: TreeNode) -> list[TreeNode]:
        path = []
        while node.value is None:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        return path

    # ---- the host tier ------------------------------------------------------------
    def load(self, node: TreeNode) -> np.ndarray:
        """Give the host-resident tail of the path to `node` device slots and plan the
        copies; returns those slots in path order. The caller locked `node` and made
        room (`allocator.available` >= the matched `host_len`)."""
        host = self.host
        path = self._host_only_path(node)
        if not path:
            return _empty_slots()
        assert host is not None, "a host-only node without a host tier"
        total = sum(len(p) for p in path)
        dev = self.allocator.alloc(total)
        if dev is None:
            raise RuntimeError(f"load of {total} tokens with {self.allocator.available} free")
        pos = 0
        for p in path:
            run = _frozen(dev[pos : pos + len(p)].copy())
            assert p.host_value is not None
            host.load(p.host_value, run)
            p.copy_epoch = host.epoch
            self._retier(p, device=run)
            pos += len(p)
        return dev

    def take_copies(self) -> KVCopies | None:
        """This step's copy plan (the engine hands it to the runner before the forward)."""
        return None if self.host is None else self.host.take()

    def _write_back(self, node: TreeNode) -> bool:
        """Give `node` a host copy (a write planned unless it has one); False: no room."""
        host = self.host
        assert host is not None and node.value is not None
        if node.host_value is not None:
            return True
        n = len(node)
        if host.allocator.available < n:
            self._evict_host(n - host.allocator.available)
        slots = host.allocator.alloc(n)
        if slots is None:
            return False
        host.write(node.value, slots)
        node.copy_epoch = host.epoch
        self._retier(node, host=_frozen(slots))
        return True

    def _evict_host(self, num_tokens: int) -> int:
        """Drop at least `num_tokens` host slots (when that many may go), LRU first: the
        host copy of a device node, or a host-only leaf with its node."""
        host = self.host
        assert host is not None
        if len(self._host_heap) > 2 * len(self._host_nodes) + 1024:
            self._rebuild_host_heap()
        heap, epoch = self._host_heap, host.epoch
        freed = 0
        kept: list[tuple[int, int, TreeNode]] = []
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            tick, _, node = entry
            if tick != node.host_tick:
                continue  # dead
            if node.last_access != tick:
                self._push_host(node)
                continue
            host_only = node.value is None
            if node.copy_epoch == epoch or (host_only and node.lock_ref):
                kept.append(entry)  # copied this step, or about to be loaded
                continue
            if host_only and node.children:
                node.host_tick = -1  # pushed again when its last child goes
                continue
            assert node.host_value is not None
            freed += len(node)
            host.allocator.free(node.host_value)
            if host_only:
                self._remove(node)
            else:
                self._retier(node, host=None)
        for entry in kept:
            heapq.heappush(heap, entry)
        host.dropped_tokens += freed
        return freed

    def _push_host(self, node: TreeNode) -> None:
        node.host_tick = node.last_access
        heapq.heappush(self._host_heap, (node.last_access, node.id, node))

    def _rebuild_host_heap(self) -> None:
        for node in self._host_nodes:
            node.host_tick = node.last_access
        self._host_heap = [(n.last_access, n.id, n) for n in self._host_nodes]
        heapq.heapify(self._host_heap)

    # ---- tiers --------------------------------------------------------------------
    def _retier(self, node: TreeNode, device: Any = _KEEP, host: Any = _KEEP) -> None:
        """The one place a node's residency changes (new slots, or None: gone from that
        tier): sizes, the device-leaf set and both LRU heaps follow. Callers free or
        hand over the slots; a node with neither tier left is detached (`_remove`)."""
        parent = node.parent
        assert parent is not None
        was_device, was_host = node.value is not None, node.host_value is not None
        if device is not _KEEP and (device is None) != (node.value is None):
            n = len(node)
            if device is None:  # off the device
                parent.dev_children -= 1
                self._leaves.discard(node)
                node.heap_tick = -1
                if (
                    parent.parent is not None
                    and parent.value is not None
                    and not parent.dev_children
                ):
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
        if device is not _KEEP:
            node.value = device
            if device is not None and node in self._leaves:
                self._push(node)
            if node.host_value is not None and node.host_tick < 0:
                self._push_host(node)  # a device node's host copy may always be dropped
        if host is not _KEEP:
            node.host_value = host
            if host is None:
                self._host_nodes.discard(node)
                node.host_tick = -1
            else:
                self._host_nodes.add(node)
                self._push_host(node)
        if self.kv_events is not None:  # after both tiers are set: a republish sees them
            moved_device = device is not _KEEP and (device is None) == was_device
            moved_host = host is not _KEEP and (host is None) == was_host
            if moved_device or moved_host:
                self.kv_events.retiered(
                    node,
                    (device is not None) if moved_device else None,
                    (host is not None) if moved_host else None,
                )

    def _remove(self, node: TreeNode) -> None:
        """Detach a node held in no tier any more (slots already freed by the caller)."""
        parent = node.parent
        assert parent is not None and not node.children
        self._retier(node, device=None, host=None)  # reports its blocks removed per tier
        del parent.children[node.kb[: self._kbytes]]
        node.parent = None
        if parent.parent is not None and parent.value is None and not parent.children:
            self._push_host(parent)  # a host-only leaf now: the host LRU may drop it

    def _drop_subtree(self, node: TreeNode) -> list[np.ndarray]:
        """Remove `node` (unlocked, so is all below it) and everything below it; frees
        their host slots and returns their device slots for the caller to free."""
        host_runs = []
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        runs = [n.value for n in order if n.value is not None]
        for n in reversed(order):  # leaves first
            if n.host_value is not None:
                host_runs.append(n.host_value)
            self._remove(n)
        if host_runs and self.host is not None:
            self.host.allocator.free(np.concatenate(host_runs))
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
        LRU device leaves up; with a host tier they stay cached there (written back)."""
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
            assert node.value is not None
            freed += len(node)
            if self.host is not None and self._write_back(node):
                runs.append(node.value)
                self._retier(node, device=None)
            else:
                runs.extend(self._drop_subtree(node))
        for entry in locked:
            heapq.heappush(heap, entry)
        if runs:
            self.allocator.free(np.concatenate(runs))
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
        """Drop every unlocked entry in both tiers and every host copy (flush_cache);
        locked paths stay on the device. Loads already planned still run."""
        dev_runs: list[np.ndarray] = []
        host_runs: list[np.ndarray] = []
        for node in self._nodes():  # parents before children
            if node.parent is None:
                continue  # under a subtree dropped already
            if node.host_value is not None:
                host_runs.append(node.host_value)
                self._retier(node, host=None)
            if node.lock_ref == 0:
                dev_runs.extend(self._drop_subtree(node))
        if dev_runs:
            self.allocator.free(np.concatenate(dev_runs))
        if self.host is not None:
            if host_runs:
                self.host.allocator.free(np.concatenate(host_runs))
            self.host.drop_writes()
        self._rebuild_heap()
        self._host_heap = []

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

    @property
    def host_size(self) -> int:
        """Host tokens cached (host-only nodes and host copies of device nodes)."""
        return 0 if self.host is None else self.host.used

    def _nodes(self) -> list[TreeNode]:
        """Every node, each after its parent."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_slots(self) -> np.ndarray:
        """Every device slot the tree holds."""
        runs = [node.value for node in self._nodes() if node.value is not None]
        return np.concatenate(runs) if runs else _empty_slots()

    def cached_host_slots(self) -> np.ndarray:
        """Every host slot the tree holds."""
        runs = [node.host_value for node in self._nodes() if node.host_value is not None]
        return np.concatenate(runs) if runs else _empty_slots()

    def check_integrity(self) -> None:
        """Assert the tree's invariants in both tiers (AssertionError naming the first
        one broken). Device slots are checked against the allocator by the scheduler."""
        nodes = self._nodes()
        evictable = protected = 0
        for node in nodes:
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            assert parent.children.get(node.kb[: self._kbytes]) is node, f"{node!r} misfiled"
            assert len(node.kb) > 0, f"{node!r} empty key"
            assert len(node) % self.page_size == 0, f"{node!r} not page-aligned"
            assert node.value is not None or node.host_value is not None, f"{node!r} in no tier"
            for run in (node.value, node.host_value):
                if run is not None:
                    assert len(run) == len(node), f"{node!r} key/slots mismatch"
                    assert not run.flags.writeable, f"{node!r} slots writable"
            if node.value is not None:
                assert parent.value is not None, f"{node!r} on the device under a host-only node"
            else:
                assert self.host is not None, f"{node!r} host-only without a host tier"
            dev_children = sum(c.value is not None for c in node.children.values())
            assert node.dev_children == dev_children, f"{node!r} device child count wrong"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, f"{node!r} lock_ref below its children's"
            is_leaf = node.value is not None and not dev_children
            assert (node in self._leaves) == is_leaf, f"{node!r} leaf set wrong"
            assert (node in self._host_nodes) == (node.host_value is not None), (
                f"{node!r} host set wrong"
            )
            if node.value is not None:
                if node.lock_ref > 0:
                    protected += len(node)
                else:
                    evictable += len(node)
        n_leaves = sum(1 for n in nodes if n.value is not None and not n.dev_children)
        assert len(self._leaves) == n_leaves, "stale leaves"
        assert len(self._host_nodes) == sum(n.host_value is not None for n in nodes), "stale host"
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
        host = self.host
        if host is None:
            return
        hentries = {(tick, node.id) for tick, _, node in self._host_heap}
        for node in self._host_nodes:  # droppable host holders are in the host LRU
            if node.value is not None or not node.children:
                assert (node.host_tick, node.id) in hentries, f"{node!r} missing from host LRU"
        host.allocator.check_integrity(owned=self.cached_host_slots())


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

    def load(self, node: TreeNode) -> np.ndarray:
        return _empty_slots()

    def take_copies(self) -> KVCopies | None:
        return None

    def check_integrity(self) -> None:
        assert not self.root.children, "NoCache holds entries"
