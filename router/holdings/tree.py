"""Approximate multi-tenant radix tree: which worker probably caches which prefix.

One shared tree over sequences, with the same code: ``str`` for request text, and for
token ids their ``TokenKey`` (shared/tokens/prompt_ids.py: the ids' bytes as a str, four
chars an id, so ids compare and slice as text does, in C, with no int object per id; a
``width=4`` tree counts them in ids). A ``tuple[int, ...]`` works too, item by item.
Each node holds a run of elements and records which tenants (workers) hold it and when
each last used it. A tenant that holds a node holds every ancestor too, so each
tenant's logical tree is the set of nodes it holds.

Worked example (``dump()`` renders exactly this; tests/router/holdings/test_tree.py asserts it)::

    tree = PrefixTree()
    tree.insert("hello world", "a", now=1)
    tree.insert("hello there", "b", now=2)
    tree.insert("help", "a", now=3)

    'hel' a@3 b@2
      'lo ' a@1 b@2
        'there' b@2
        'world' a@1
      'p' a@3

    tree.match("hello thx")  == {"b": 8, "a": 6}   # b: 'hel'+'lo '+'th'; a: up to 'lo '
    tree.tenant_size("a")    == 12                 # 'hel' + 'lo ' + 'world' + 'p'

Cost model, the reason for the shape:

- Runs are compared as slices (one C-level memcmp), and a divergence inside a run is
  found by bisection over slice equality, so an 8,000-char prompt costs a few
  microseconds, not a Python loop per character.
- Eviction is per tenant, least recently used first, O(removed): each tenant keeps
  an ``OrderedDict`` of the nodes it holds. A path is touched leaf first, root last,
  so a node always sits after its descendants and the head is a tenant-leaf. (A
  split puts the new lower half at the tail; it is then only evicted together with
  its upper half, which is what the unsplit node would have been.)
- Units: a unit is ``width`` elements (1: a char; 4: an id of a ``TokenKey``). Every
  size, cap, budget and match length the tree takes or gives is in units; inside it
  counts elements. Two keys can part inside an id (ids that share their low bytes): a
  match ends at the last whole unit, a path entry that adds no whole unit is left out,
  and the shared bytes are stored and counted once (a size under the ids' by less than
  an id per such split).
- Sizes: ``tenant_size`` is a tenant's logical units (its own cap applies to it);
  ``total_chars`` is the units actually stored, shared nodes counted once (the global
  budget applies to it, as it is what costs memory). Crossing a budget on insert
  evicts down to ``(1 - hysteresis) × budget`` in one go, so the work is amortised;
  the global budget takes the globally oldest tenant entry first (a heap over the
  tenants' LRU heads), so a shared node is freed once every holder has let it go.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from itertools import repeat
from typing import Generic, TypeVar

Seq = TypeVar("Seq", str, tuple[int, ...])
Tenant = Hashable
_NEVER = float("-inf")  # `overflowed_at` of a tenant never over its cap


class _Node(Generic[Seq]):
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: Seq, parent: _Node[Seq] | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[object, _Node[Seq]] = {}
        self.tenants: dict[Tenant, float] = {}  # tenant -> last time it used this node


def _common_len(text: Seq, pos: int, key: Seq) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``key``; first elements equal.

    Bisection that only compares the not-yet-known interval each round, so the total
    bytes compared stay O(len(key)) rather than O(len(key) · log len(key)).
    """
    lo, hi = 1, min(len(key), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text[pos + lo : pos + mid] == key[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree(Generic[Seq]):
    """Shared radix tree with one bounded, LRU-evicted logical tree per tenant."""

    def __init__(
        self, max_chars: int | None = None, hysteresis: float = 0.05, width: int = 1
    ) -> None:
        if max_chars is not None and max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.max_chars = max_chars  # in units
        self.hysteresis = hysteresis
        self.width = width  # elements per unit (module doc)
        self._budget = None if max_chars is None else max_chars * width  # in elements
        self._root: _Node[Seq] = _Node(None, None)  # type: ignore[arg-type]
        # Below, sizes and caps are in elements (units x width).
        self._total = 0  # elements stored, shared nodes once
        self._size: dict[Tenant, int] = {}  # elements per tenant (its logical tree)
        self._lru: dict[Tenant, OrderedDict[_Node[Seq], None]] = {}  # head = oldest
        self._cap: dict[Tenant, int] = {}
        # When an insert last pushed each tenant over its cap: routes that overflow a
        # worker's pool (router/holdings/merge.py reads it).
        self._overflowed: dict[Tenant, float] = {}
        # The last walk of `match_path`: (text, the deepest node it ran through whole, the
        # position after it). Routing inserts the text it matched (router/routing.py), so
        # `insert` of that same text object starts there and takes the nodes above from
        # their parents: one walk down the tree a decision, not two. A split or a detach
        # may move that node: both drop it.
        self._walked: tuple[Seq, _Node[Seq], int] | None = None
        # Whether every insert's `now` was at or after the one before (none NaN): then a
        # tenant's time on a node is never after its time on the node's parent (an insert
        # stamps the whole path from the root), so along a match path each holder's
        # oldest time is the one of the deepest entry it holds (router/holdings/merge.py's
        # window reads only that). The router's clock is monotonic; a test's may not be.
        self.monotone = True
        self._latest = float("-inf")  # the latest insert's `now`

    # ---- queries -------------------------------------------------------------------

    @property
    def total_chars(self) -> int:
        """Units stored, shared nodes counted once."""
        return self._total // self.width

    def tenants(self) -> list[Tenant]:
        return list(self._size)

    def tenant_size(self, tenant: Tenant) -> int:
        return self._size.get(tenant, 0) // self.width

    def tenant_nodes(self, tenant: Tenant) -> int:
        return len(self._lru.get(tenant, ()))

    def tenant_sizes(self, tenants: Iterable[Tenant]) -> list[int]:
        """``tenant_size`` of each, in order: one C-level pass for a whole fleet."""
        sizes = list(map(self._size.get, tenants, repeat(0)))
        width = self.width
        return sizes if width == 1 else [s // width for s in sizes]

    def match_path(self, text: Seq) -> list[tuple[Mapping[Tenant, float], int]]:
        """The nodes ``text`` runs through, root side first, as (holders, matched length
        at that node's end, or where ``text`` leaves it). Read-only views, not copies.

        A tenant's match is the ``end`` of the deepest entry it holds, and each entry's
        holders are a subset of the one before, so a caller that wants only the best
        holders reads from the end and stops early: no per-tenant work for the rest.
        Read-only: routing inserts the text for the chosen tenant afterwards, which is
        what refreshes its recency.
        """
        node, pos, n, width = self._root, 0, len(text), self.width
        is_str = isinstance(text, str)  # str compares in place; tuples have no startswith
        path: list[tuple[Mapping[Tenant, float], int]] = []
        # Ends in whole units (`width` elements, a TokenKey): an entry that ends inside the
        # unit where the one before it ended adds nothing its holders are known to hold.
        # One pass (a second over the path cost ~2 us a 2k-id chat of 30 turns).
        last = 0
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            key = child.key
            k = len(key)
            if text.startswith(key, pos) if is_str else text[pos : pos + k] == key:  # type: ignore[union-attr]
                pos += k
                units = pos // width
                if units > last:
                    path.append((child.tenants, units))
                    last = units
                node = child
                continue
            units = (pos + _common_len(text, pos, key)) // width
            if units > last:
                path.append((child.tenants, units))
            break
        self._walked = (text, node, pos)
        return path

    def match(self, text: Seq) -> dict[Tenant, int]:
        """Per tenant, the length of the longest prefix of ``text`` it holds (> 0 only)."""
        out: dict[Tenant, int] = {}
        path = self.match_path(text)
        # Root side first, so a deeper (longer) end overwrites a shallower one. An entry
        # with as many holders as the next has the same holders: skip it.
        for i, (held, end) in enumerate(path):
            if i + 1 < len(path) and len(path[i + 1][0]) == len(held):
                continue
            out.update(zip(held, repeat(end)))
        return out

    # ---- updates -------------------------------------------------------------------

    def insert(self, text: Seq, tenant: Tenant, now: float) -> None:
        """Record that ``tenant`` now holds ``text`` (last used at ``now``), then enforce
        the tenant's cap and the global budget."""
        if now >= self._latest:
            self._latest = now
        else:  # (NaN too)
            self.monotone = False
        if tenant not in self._size:
            self._size[tenant] = 0
            self._lru[tenant] = OrderedDict()
        root = node = self._root
        pos, n = 0, len(text)
        walked = self._walked
        if walked is not None and walked[0] is text:  # matched just before: go on from there
            self._walked = None
            node, pos = walked[1], walked[2]
        start = node
        is_str = isinstance(text, str)
        path: list[_Node[Seq]] = []
        while pos < n:
            first = text[pos]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(text[pos:], node)
                node.children[first] = leaf
                self._total += n - pos
                path.append(leaf)
                break
            key = child.key
            k = len(key)
            if not (text.startswith(key, pos) if is_str else text[pos : pos + k] == key):  # type: ignore[union-attr]
                child = self._split(child, _common_len(text, pos, key))
                k = len(child.key)
            path.append(child)
            node = child
            pos += k
        # Leaf first, then `start` and its ancestors: ancestors end up after descendants.
        path.reverse()
        while start is not root:
            path.append(start)
            start = start.parent  # type: ignore[assignment]
        size, lru = self._size, self._lru[tenant]
        gained = 0
        for held in path:
            times = held.tenants
            if tenant in times:
                lru.move_to_end(held)
            else:
                gained += len(held.key)
                lru[held] = None
            times[tenant] = now
        size[tenant] += gained
        cap = self._cap.get(tenant)
        if cap is not None and size[tenant] > cap:
            self._overflowed[tenant] = now
            self._shrink_tenant(tenant, int(cap * (1.0 - self.hysteresis)))
        budget = self._budget
        if budget is not None and self._total > budget:
            self._shrink_global(int(budget * (1.0 - self.hysteresis)))

    def overflowed_at(self, tenant: Tenant) -> float:
        """When an insert last pushed ``tenant`` over its cap (-inf: never)."""
        return self._overflowed.get(tenant, _NEVER)

    def set_cap(self, tenant: Tenant, max_chars: int | None) -> None:
        """Bound one tenant's logical tree, in units (None: only the global budget applies)."""
        if max_chars is None:
            self._cap.pop(tenant, None)
            return
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        cap = max_chars * self.width
        self._cap[tenant] = cap
        if self._size.get(tenant, 0) > cap:
            self._shrink_tenant(tenant, int(cap * (1.0 - self.hysteresis)))

    def evict(self, tenant: Tenant, chars: int) -> int:
        """Evict at least ``chars`` units of ``tenant``'s least recently used entries;
        returns the units evicted."""
        before = self._size.get(tenant, 0)
        self._shrink_tenant(tenant, max(0, before - chars * self.width))
        return (before - self._size.get(tenant, 0)) // self.width

    def remove_tenant(self, tenant: Tenant) -> None:
        """Forget a tenant entirely (worker left, or restarted with an empty cache)."""
        lru = self._lru.pop(tenant, None)
        self._size.pop(tenant, None)
        self._cap.pop(tenant, None)
        self._overflowed.pop(tenant, None)
        for node in lru or ():
            del node.tenants[tenant]
            if not node.tenants:
                self._detach(node)

    # ---- internals -----------------------------------------------------------------

    def _split(self, node: _Node[Seq], at: int) -> _Node[Seq]:
        """Cut ``node`` at ``at``; ``node`` keeps the upper half (and its LRU slots) and
        a new lower node takes the rest. Returns the upper half."""
        self._walked = None
        lower: _Node[Seq] = _Node(node.key[at:], node)
        lower.children = node.children
        for child in lower.children.values():
            child.parent = lower
        lower.tenants = dict(node.tenants)
        for tenant in lower.tenants:
            self._lru[tenant][lower] = None
        node.key = node.key[:at]
        node.children = {lower.key[0]: lower}
        return node

    def _detach(self, node: _Node[Seq]) -> None:
        self._walked = None
        parent = node.parent
        if parent is not None and parent.children.get(node.key[0]) is node:
            del parent.children[node.key[0]]
            self._total -= len(node.key)

    def _evict_head(self, tenant: Tenant) -> None:
        """Drop the tenant's LRU node and whatever it still holds below it."""
        lru = self._lru[tenant]
        head = next(iter(lru))
        order = [head]
        if head.children:  # a tenant-leaf can still have children held by others
            stack = [c for c in head.children.values() if tenant in c.tenants]
            while stack:  # non-empty only for the lower half of a split (see module doc)
                node = stack.pop()
                order.append(node)
                stack.extend(c for c in node.children.values() if tenant in c.tenants)
        freed = 0
        for node in reversed(order):  # deepest first, so detaching never orphans
            del node.tenants[tenant]
            del lru[node]
            freed += len(node.key)
            if not node.tenants:
                self._detach(node)
        self._size[tenant] -= freed

    def _shrink_tenant(self, tenant: Tenant, target: int) -> None:
        while self._size.get(tenant, 0) > target:
            self._evict_head(tenant)

    def _shrink_global(self, target: int) -> None:
        # Globally least recently used first: a heap of each tenant's oldest entry, so
        # a removal costs O(log tenants). The index breaks ties (tenants need no order).
        heap = [
            (next(iter(lru)).tenants[tenant], i, tenant)
            for i, (tenant, lru) in enumerate(self._lru.items())
            if lru
        ]
        heapq.heapify(heap)
        while self._total > target and heap:
            _, i, tenant = heapq.heappop(heap)
            self._evict_head(tenant)
            lru = self._lru[tenant]
            if lru:
                heapq.heappush(heap, (next(iter(lru)).tenants[tenant], i, tenant))

    # ---- introspection (tests, debugging) -------------------------------------------

    def _walk(self) -> Iterator[tuple[int, _Node[Seq]]]:
        stack = [(0, c) for c in sorted(self._root.children.values(), key=_sort_key, reverse=True)]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            kids = sorted(node.children.values(), key=_sort_key, reverse=True)
            stack.extend((depth + 1, c) for c in kids)

    def dump(self) -> str:
        """One line per node, children sorted: ``<indent><key!r> <tenant>@<time> ...``."""
        lines = []
        for depth, node in self._walk():
            held = " ".join(f"{t}@{_fmt(ts)}" for t, ts in sorted(node.tenants.items(), key=str))
            lines.append(f"{'  ' * depth}{node.key!r} {held}")
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Assert every invariant the bookkeeping relies on (tests call it after steps)."""
        total, sizes, counts = 0, dict.fromkeys(self._size, 0), dict.fromkeys(self._size, 0)
        for _, node in self._walk():
            assert node.key, "empty node"
            assert node.tenants, f"node {node.key!r} held by no tenant"
            parent = node.parent
            assert parent is not None and parent.children[node.key[0]] is node
            total += len(node.key)
            for tenant in node.tenants:
                assert parent is self._root or tenant in parent.tenants, "tenant gap on path"
                assert node in self._lru[tenant], "held node missing from tenant LRU"
                sizes[tenant] += len(node.key)
                counts[tenant] += 1
        assert total == self._total, (total, self._total)
        assert sizes == self._size, (sizes, self._size)
        assert counts == {t: len(lru) for t, lru in self._lru.items()}


def _sort_key(node: _Node[Seq]) -> tuple[str, object]:
    return (type(node.key).__name__, node.key)


def _fmt(t: float) -> str:
    return str(int(t)) if float(t).is_integer() else str(t)
