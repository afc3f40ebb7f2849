"""KV events out of the radix cache: which fixed-size token blocks it holds, as they change.

The cache keeps tokens at page granularity; routers index blocks of `block_size` tokens
along each path from the root (vLLM's schema, shared/wire/kv_events.py). A block is held
while the tree holds its last token, so each block belongs to the node holding its end:

    depth   0 ........ 16 ........ 32 ........ 48      block_size 16
    path    [ node A: 0..20 ][ node B: 20..41  ][ C: 41..50 ]
    blocks  A: end 16         B: ends 32        C: end 48
            (block 16..32 starts in A but ends in B: evicting leaf B removes it)

So the tree's changes map to events one to one:
- a new leaf (insert) stores the blocks that end in it on the device (`stored`);
- a node entering or leaving a tier stores or removes its blocks there (`retiered`, with
  that tier's medium: `medium` for the device pool, "GPU" as vLLM names it, and
  `host_medium`, "CPU" as vLLM's CPU offloading names its host tier);
- a split moves each block to whichever half holds its end (`split`; no event: both
  halves keep the node's tiers).

A block is held in a tier when the node holding its end is (device residency is closed
upwards, so a block on the device has all its tokens there; a block whose end node is
host-resident has its tokens on the host or the device, and a match loads it). With the
host tier (hiradix_cache.py) the moves are:

    demotion (device LRU evicts a leaf)   BlockStored CPU (the write-back), BlockRemoved GPU
    load back (a match reaches it)        BlockStored GPU; the host copy stays (CPU held)
    host LRU drops a copy                 BlockRemoved CPU (and the node, if host-only)
    flush (reset)                         BlockRemoved in each tier, for every block
    a node leaves the tree                BlockRemoved in each tier it was in

Each node records the hashes of the blocks ending in it (`blocks`) and where in the node
the first block boundary falls (`bend`, 1..block_size), which is all a split needs.
The engine thread appends to a deque; the worker's publisher drains it from the event loop.
If the publisher falls behind by `max_pending` events, the backlog is dropped and the
next change republishes the whole tree after an AllBlocksCleared, so a reader never
holds a block the cache lost without being told.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from shared.wire.kv_events import (
    MAX_EVENT_TOKENS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    engine_block_hash,
)
from worker.engine.salt import TOKEN_MASK, SaltNames, tag_of


class BlockNode(Protocol):
    """What the hook reads and writes of a radix tree node (tree_node.TreeNode; not
    imported: the import chain stays short, and the hook needs only these fields)."""

    parent: BlockNode | None
    children: dict[bytes, BlockNode]
    kb: bytes
    value: np.ndarray | None  # None: host-resident only (its tokens: len(kb) // 8)
    host_value: np.ndarray | None  # None: no host copy
    blocks: tuple[int, ...]
    bend: int


_TB = 8  # bytes per token id in a node key (int64), as tree_node.TOKEN_BYTES
MAX_EVENT_BLOCKS = 1024  # blocks per BlockStored (shared/wire/kv_events.MAX_BLOCKS bounds readers)


class BlockEvents:
    """The radix cache's hook: node changes in, KV events out."""

    def __init__(
        self,
        block_size: int,
        medium: str = MEDIUM_GPU,
        max_pending: int = 200_000,
        host_medium: str | None = MEDIUM_CPU,
        salts: SaltNames | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Blocks per BlockStored: readers bound an event's blocks and its token ids
        # (MAX_EVENT_TOKENS: 1,024 blocks of 4,096 tokens would be refused).
        self.event_blocks = max(1, min(MAX_EVENT_BLOCKS, MAX_EVENT_TOKENS // block_size))
        self.medium = medium  # the device pool's
        self.host_medium = host_medium  # the host tier's (None: its moves are not published)
        self.max_pending = max_pending
        self.pending: deque[KVEvent] = deque([AllBlocksCleared()])  # a new epoch: empty
        self.dropped = 0  # events lost to a full backlog (then the tree is republished)
        self._lost = False
        self._due = False  # a republish was requested (request_republish)
        self._snapshot = 0  # events of the last republish still counted in `pending`
        self.root: BlockNode | None = None  # set by the cache; the republish walks it
        self.salts = salts if salts is not None else SaltNames()

    def _block(
        self, hashes: tuple[int, ...], parent: int | None, key: np.ndarray, medium: str
    ) -> BlockStored:
        """One BlockStored of tree-key tokens `key`: the real token ids, and a salted
        namespace's salt on the path's first block (parent None), as vLLM's extra_keys
        (worker/engine/salt.py)."""
        tag = tag_of(key) if parent is None else None
        extra = None
        if tag is not None:
            extra = ((self.salts.of(tag),), *([None] * (len(hashes) - 1)))
        ids = key & TOKEN_MASK  # a salted key's first two elements carry its tag
        return BlockStored(hashes, parent, ids, self.block_size, medium, extra)

    def _emit(self, event: KVEvent) -> None:
        if len(self.pending) >= self.max_pending + self._snapshot:
            self.dropped += len(self.pending)
            self.pending.clear()
            self._lost = True
        if not self._lost:
            self.pending.append(event)

    def request_republish(self) -> None:
        """Republish the whole tree at the next store (any thread): readers that start
        after the stream dropped this epoch's first entries resync at its AllBlocksCleared."""
        self._due = True

    def drain(self, limit: int, max_tokens: int = 1 << 62) -> list[KVEvent]:
        """Up to `limit` events carrying about `max_tokens` token ids at most, oldest
        first (any thread; deque pops are atomic)."""
        out: list[KVEvent] = []
        pending, tokens = self.pending, 0
        while pending and len(out) < limit and tokens < max_tokens:
            event = pending.popleft()
            out.append(event)
            if isinstance(event, BlockStored):
                tokens += len(event.token_ids)
        self._snapshot = max(0, self._snapshot - len(out))
        return out

    # ---- the three tree changes ---------------------------------------------------
    def stored(self, leaf: BlockNode, arr: np.ndarray, start: int, end: int) -> None:
        """`leaf` now holds arr[start:end] (token positions along its path)."""
        if self._lost or self._due:
            self._republish()
        bs = self.block_size
        leaf.bend = (start // bs + 1) * bs - start
        first, stop = start // bs, end // bs  # blocks first..stop-1 end inside the leaf
        if first >= stop:
            return
        parent = _last_block(leaf.parent)
        hashes: list[int] = []
        tokens = arr[first * bs : stop * bs]
        raw = tokens.tobytes()
        prev = parent
        for j in range(stop - first):
            prev = engine_block_hash(prev, raw[j * bs * _TB : (j + 1) * bs * _TB])
            hashes.append(prev)
        leaf.blocks = tuple(hashes)
        for i in range(0, len(hashes), self.event_blocks):  # readers bound an event's size
            chunk = leaf.blocks[i : i + self.event_blocks]
            ids = tokens[i * bs : (i + len(chunk)) * bs].copy()  # not a view of the request's
            self._emit(self._block(chunk, parent, ids, self.medium))
            parent = chunk[-1]

    def retiered(self, node: BlockNode, device: bool | None, host: bool | None) -> None:
        """`node` (its tiers already updated) entered (True) or left (False) the device
        pool and/or the host tier (None: unchanged there)."""
        if not node.blocks:
            return
        if self._lost or self._due:
            self._republish()  # the tree as it is now, this change included
            return
        for medium, held in ((self.medium, device), (self.host_medium, host)):
            if held is not None and medium is not None:
                self._tier(node, medium, held)

    def _tier(self, node: BlockNode, medium: str, held: bool) -> None:
        if not held:
            self._emit(BlockRemoved(node.blocks, medium))
            return
        parent = _last_block(node.parent)
        tokens = self._tokens_of(node)
        bs = self.block_size
        for i in range(0, len(node.blocks), self.event_blocks):
            chunk = node.blocks[i : i + self.event_blocks]
            self._emit(self._block(chunk, parent, tokens[i * bs : (i + len(chunk)) * bs], medium))
            parent = chunk[-1]

    def _tokens_of(self, node: BlockNode) -> np.ndarray:
        """The token ids of the blocks ending in `node`: the first one starts up to
        block_size - 1 tokens above it (in its parent, or further up past short nodes)."""
        bs = self.block_size
        end = node.bend + (len(node.blocks) - 1) * bs  # where the last block ends in it
        need = (bs - node.bend) * _TB  # bytes of the first block above the node
        above, p = b"", node.parent
        while len(above) < need and p is not None:
            above = p.kb + above
            p = p.parent
        raw = (above[len(above) - need :] if need else b"") + node.kb[: end * _TB]
        return np.frombuffer(raw, dtype=np.int64).copy()

    def split(self, upper: BlockNode, lower: BlockNode, m: int) -> None:
        """`lower` (the old node) lost its first m tokens to the new `upper`."""
        bs, bend, blocks = self.block_size, lower.bend, lower.blocks
        upper.bend = bend
        n_upper = 0 if bend > m else (m - bend) // bs + 1
        upper.blocks, lower.blocks = blocks[:n_upper], blocks[n_upper:]
        lower.bend = (bend - 1 - m) % bs + 1

    # ---- republish after a lost backlog -------------------------------------------
    def _republish(self) -> None:
        """AllBlocksCleared, then every block the tree holds, in each tier holding it
        (parents before children)."""
        self._lost = self._due = False
        self.pending.append(AllBlocksCleared())
        if self.root is None:
            return
        bs = self.block_size
        stack: list[tuple[BlockNode, bytes, int | None]] = [
            (c, b"", None) for c in self.root.children.values()
        ]
        while stack:
            node, above, parent = stack.pop()
            path = above + node.kb
            if node.blocks:
                depth = len(path) // _TB
                first = (depth - len(node.kb) // _TB + node.bend) // bs - 1
                raw = path[first * bs * _TB : (first + len(node.blocks)) * bs * _TB]
                tokens = np.frombuffer(raw, dtype=np.int64)
                media = [m for m, held in ((self.medium, node.value is not None),
                         (self.host_medium, node.host_value is not None)) if held and m]  # fmt: skip
                for medium in media:  # each tier holding the node: one chain of stores
                    up = parent
                    for i in range(0, len(node.blocks), self.event_blocks):
                        chunk = node.blocks[i : i + self.event_blocks]
                        ids = tokens[i * bs : (i + len(chunk)) * bs].copy()
                        self.pending.append(self._block(chunk, up, ids, medium))
                        up = chunk[-1]
                parent = node.blocks[-1]
            stack.extend((c, path, parent) for c in node.children.values())
        self._snapshot = len(self.pending)  # a republish never overflows the backlog itself


def _last_block(node: BlockNode | None) -> int | None:
    """The hash of the last block ending at or above `node` (None at the root)."""
    while node is not None:
        if node.blocks:
            return node.blocks[-1]  # type: ignore[return-value]
        node = node.parent
    return None
