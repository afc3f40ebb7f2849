"""The radix tree's invariants (worker/engine/radix_cache.py), checked apart from the
cache's own code: `RadixCache.check_integrity` runs them under debug checks and in tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_tree(cache: Any) -> None:  # a RadixCache: that module imports this one
    """Assert the device tree's invariants (AssertionError naming the first one broken);
    `cache._check_node` adds the host tier's per node. Device slots are checked against
    the allocator by the scheduler."""
    nodes = cache._nodes()
    sizes = [0, 0]  # device tokens: evictable, protected
    for node in nodes:
        parent = node.parent
        assert parent is not None, f"{node!r} has no parent"
        assert parent.children.get(node.kb[: cache._kbytes]) is node, f"{node!r} misfiled"
        assert len(node.kb) > 0, f"{node!r} empty key"
        assert len(node) % cache.page_size == 0, f"{node!r} not page-aligned"
        assert node.value is not None or node.host_value is not None, f"{node!r} in no tier"
        for run in (node.value, node.host_value):
            if run is not None:
                assert len(run) == len(node), f"{node!r} key/slots mismatch"
                assert not run.flags.writeable, f"{node!r} slots writable"
        if node.value is not None:
            assert parent.value is not None, f"{node!r} on the device under a host-only node"
        cache._check_node(node)
        dev_children = sum(c.value is not None for c in node.children.values())
        assert node.dev_children == dev_children, f"{node!r} device child count wrong"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, f"{node!r} lock_ref below its children's"
        is_leaf = node.value is not None and not dev_children
        assert (node in cache._leaves) == is_leaf, f"{node!r} leaf set wrong"
        if node.value is not None:
            sizes[node.lock_ref > 0] += len(node)
    n_leaves = sum(1 for n in nodes if n.value is not None and not n.dev_children)
    assert len(cache._leaves) == n_leaves, "stale leaves"
    entries = {(tick, node.id) for tick, _, node in cache._heap}
    for leaf in cache._leaves:  # every leaf has a live entry no later than its last use
        assert (leaf.heap_tick, leaf.id) in entries, f"{leaf!r} missing from the LRU heap"
        assert 0 <= leaf.heap_tick <= leaf.last_access, f"{leaf!r} heap entry from the future"
    assert sizes == [cache._evictable, cache._protected], f"sizes wrong, tree: {sizes}"
    cache.second_chance.check(nodes)
    slots = cache.cached_slots()
    if len(slots):
        assert slots.min() >= 0 and slots.max() < cache.allocator.capacity, "slot out of range"
        assert np.bincount(slots).max() == 1, "a slot is cached twice"
