"""HiRadixCache: the radix cache with a host tier (SGLang's HiCache idea, kept beside the
device cache as SGLang keeps hiradix_cache.py beside radix_cache.py).

A node's KV may sit on the device (`value`), in host memory (`host_value`), or both.
The device LRU (radix_cache.py) evicts device leaves; here an evicted leaf keeps its
node, written back to host slots first unless it has a copy there (write-through makes
one at insert). A match may run on into host-only nodes (`MatchResult.host_len`);
`load` gives them device slots and plans the copies (host_tier.py). The host pool has
its own lazy LRU heap (the device heap's scheme), which drops host copies, and
host-only leaves with them, when it needs room.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.host_tier import HostTier
from worker.engine.radix_cache import KEEP, RadixCache
from worker.engine.tree_node import TreeNode, empty_slots, frozen
from worker.engine.types import KVCopies


class HiRadixCache(RadixCache):
    """The tree over the device pool and the host pool.

    A node is device-resident, host-resident or both; device residency is closed
    upwards. An evicted device leaf stays in the tree as host-resident; `load` brings a
    matched host-resident run back; the host LRU drops host copies when it needs room.
    """

    def __init__(
        self, allocator: SlotAllocator, host: HostTier, page_size: int = 1,
        second_chance_tokens: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(allocator, page_size, second_chance_tokens)
        self.host = host
        self._host_nodes: set[TreeNode] = set()  # nodes holding host slots
        self._host_heap: list[tuple[int, int, TreeNode]] = []  # their LRU, lazily updated

    # ---- hooks of the device tree ---------------------------------------------------
    def _split_host(self, upper: TreeNode, child: TreeNode, m: int) -> None:
        if child.host_value is not None:
            upper.host_value = frozen(child.host_value[:m].copy())
            child.host_value = frozen(child.host_value[m:].copy())
            upper.copy_epoch = child.copy_epoch
            self._host_nodes.add(upper)
            self._push_host(upper)

    def _inserted(self, leaf: TreeNode) -> None:
        if self.host.write_through:
            self._write_back(leaf)

    def _revive(self, node: TreeNode, slots: np.ndarray, start: int) -> None:
        """The host-only tail of the path ending at `node` (tokens [start, ...)) takes the
        caller's device slots for the same tokens: the same K/V, nothing to copy."""
        path = self._host_only_path(node)
        pos = start
        for p in path:
            self._retier(p, device=frozen(slots[pos : pos + len(p)].copy()))
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

    def _set_host(self, node: TreeNode, host: Any) -> None:
        if host is KEEP:
            if node.host_value is not None and node.host_tick < 0:
                self._push_host(node)  # a device node's host copy may always be dropped
            return
        node.host_value = host
        if host is None:
            self._host_nodes.discard(node)
            node.host_tick = -1
        else:
            self._host_nodes.add(node)
            self._push_host(node)

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        super()._remove(node)
        if parent.parent is not None and parent.value is None and not parent.children:
            self._push_host(parent)  # a host-only leaf now: the host LRU may drop it

    def _drop_subtree(self, node: TreeNode) -> list[np.ndarray]:
        """As the device tree's, and the subtree's host slots are freed."""
        held = [n.host_value for n in self._subtree(node) if n.host_value is not None]
        if held:
            self.host.allocator.free(np.concatenate(held))
        return super()._drop_subtree(node)

    def _evict_leaf(self, node: TreeNode) -> list[np.ndarray]:
        """Written back (kept as host-resident) when the host tier has room, else dropped."""
        if not self._write_back(node):
            return super()._evict_leaf(node)
        run = node.value
        assert run is not None
        self._retier(node, device=None)
        return [run]

    def _reset_host(self, node: TreeNode) -> None:
        if node.host_value is not None:
            self.host.allocator.free(node.host_value)
            self._retier(node, host=None)

    def reset(self) -> None:
        """Drop every unlocked entry in both tiers and every host copy (flush_cache);
        locked paths stay on the device. Loads already planned still run."""
        super().reset()
        self.host.drop_writes()
        self._host_heap = []

    # ---- the host tier ----------------------------------------------------------------
    def load(self, node: TreeNode) -> np.ndarray:
        """Give the host-resident tail of the path to `node` device slots and plan the
        copies; returns those slots in path order. The caller locked `node` and made
        room (`allocator.available` >= the matched `host_len`)."""
        host = self.host
        path = self._host_only_path(node)
        if not path:
            return empty_slots()
        total = sum(len(p) for p in path)
        dev = self.allocator.alloc(total)
        if dev is None:
            raise RuntimeError(f"load of {total} tokens with {self.allocator.available} free")
        pos = 0
        for p in path:
            run = frozen(dev[pos : pos + len(p)].copy())
            assert p.host_value is not None
            host.load(p.host_value, run)
            p.copy_epoch = host.epoch
            self._retier(p, device=run)
            pos += len(p)
        return dev

    def take_copies(self) -> KVCopies | None:
        """This step's copy plan (the engine hands it to the runner before the forward)."""
        return self.host.take()

    def _write_back(self, node: TreeNode) -> bool:
        """Give `node` a host copy (a write planned unless it has one); False: no room."""
        host = self.host
        assert node.value is not None
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
        self._retier(node, host=frozen(slots))
        return True

    def _evict_host(self, num_tokens: int) -> int:
        """Drop at least `num_tokens` host slots (when that many may go), LRU first: the
        host copy of a device node, or a host-only leaf with its node."""
        host = self.host
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

    # ---- sizes and checks -------------------------------------------------------------
    @property
    def host_size(self) -> int:
        """Host tokens cached (host-only nodes and host copies of device nodes)."""
        return self.host.used

    def cached_host_slots(self) -> np.ndarray:
        """Every host slot the tree holds."""
        runs = [node.host_value for node in self._nodes() if node.host_value is not None]
        return np.concatenate(runs) if runs else empty_slots()

    def _check_node(self, node: TreeNode) -> None:
        held = node.host_value is not None
        assert (node in self._host_nodes) == held, f"{node!r} host set wrong"

    def check_integrity(self) -> None:
        """The device tree's invariants, then the host tier's."""
        super().check_integrity()
        nodes = self._nodes()
        assert len(self._host_nodes) == sum(n.host_value is not None for n in nodes), "stale host"
        hentries = {(tick, node.id) for tick, _, node in self._host_heap}
        for node in self._host_nodes:  # droppable host holders are in the host LRU
            if node.value is not None or not node.children:
                assert (node.host_tick, node.id) in hentries, f"{node!r} missing from host LRU"
        self.host.allocator.check_integrity(owned=self.cached_host_slots())
