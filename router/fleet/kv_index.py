"""The exact index: which workers hold which token blocks, from their own KV events.

Beside the approximate prefix tree (router/policy/tree.py: what this router *sent*), the index
says what each worker *reports* holding (shared/kv_events.py). One index per model and
block size. A block is keyed by its content and its parent's key (`block_keys`), never by
the engine's hash, so workers with different hash functions (vLLM's sha256, SGLang's,
ours) that hold the same tokens hold the same block:

    blocks   key -> {worker: (media bits, engine hash)}   (LRU order; `max_blocks`)
    per worker: engine hash -> key               (what a BlockRemoved names)

A lookup (`match`) keys the request's token blocks in turn and follows the holders of
each: a worker's score is its longest run of held blocks from the start, in tokens.

Bounded memory: past `max_blocks` the least recently stored blocks are forgotten for
every holder (an under-estimate, never a wrong holder). A BlockStored whose parent the
index does not know (forgotten, or stored before a gap) cannot be keyed and is dropped
(counted as `orphan`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_key_list,
    block_keys,
)

_MEDIA = {None: 1, MEDIUM_GPU: 1, MEDIUM_CPU: 2, "STORAGE": 4}


@dataclass
class _WorkerBlocks:
    by_hash: dict[BlockHash, int] = field(default_factory=dict)  # engine hash -> key
    # Stores not yet removed, per engine hash: our engine can hold one block in two tree
    # nodes (below page granularity) and then reports it stored twice, removed twice.
    stores: dict[BlockHash, int] = field(default_factory=dict)


class BlockIndex:
    """One model's blocks of `block_size` tokens -> their holders."""

    def __init__(self, block_size: int, max_blocks: int = 2_000_000) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, dict[str, tuple[int, BlockHash]]] = OrderedDict()
        self._workers: dict[str, _WorkerBlocks] = {}
        self.orphans = 0  # stored blocks whose parent is unknown (dropped)
        self.forgotten = 0  # blocks dropped to stay under max_blocks

    # ---- events -----------------------------------------------------------------
    def apply(self, worker: str, events: Sequence[KVEvent]) -> None:
        """Apply one batch of `worker`'s events (already validated by shared/kv_events)."""
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event.block_hashes, _MEDIA.get(event.medium, 1))
            elif isinstance(event, AllBlocksCleared):
                self.drop_worker(worker)

    def _stored(self, worker: str, event: BlockStored) -> None:
        bs = self.block_size
        if event.block_size != bs:
            raise ValueError(f"block size {event.block_size} is not the index's {bs}")
        wb = self._workers.setdefault(worker, _WorkerBlocks())
        if event.parent_block_hash is None:
            parent = 0
        else:
            known = wb.by_hash.get(event.parent_block_hash)
            if known is None:
                self.orphans += len(event.block_hashes)
                return
            parent = known
        media = _MEDIA.get(event.medium, 1)
        blocks = self._blocks
        keys = block_keys(np.asarray(event.token_ids, dtype=np.int64), bs, parent).tolist()
        for parent, engine_hash in zip(keys, event.block_hashes, strict=True):
            holders = blocks.get(parent)
            if holders is None:
                blocks[parent] = holders = {}
            else:
                blocks.move_to_end(parent)
            held = holders.get(worker)
            if held is not None and held[1] != engine_hash:
                wb.by_hash.pop(held[1], None)  # the same content under a new engine hash
                wb.stores.pop(held[1], None)
            holders[worker] = (media | (held[0] if held else 0), engine_hash)
            old = wb.by_hash.get(engine_hash)
            if old is not None and old != parent:
                self._unhold(worker, old, 7)
                wb.stores.pop(engine_hash, None)
            wb.by_hash[engine_hash] = parent
            wb.stores[engine_hash] = wb.stores.get(engine_hash, 0) + 1
        while len(blocks) > self.max_blocks:
            _, holders = blocks.popitem(last=False)
            self.forgotten += 1
            for w, (_, h) in holders.items():
                self._workers[w].by_hash.pop(h, None)
                self._workers[w].stores.pop(h, None)

    def _removed(self, worker: str, hashes: Sequence[BlockHash], media: int) -> None:
        wb = self._workers.get(worker)
        if wb is None:
            return
        for engine_hash in hashes:
            left = wb.stores.get(engine_hash, 0) - 1
            if left > 0:  # another copy of the block is still stored
                wb.stores[engine_hash] = left
                continue
            wb.stores.pop(engine_hash, None)
            key = wb.by_hash.get(engine_hash)
            if key is not None and not self._unhold(worker, key, media):
                del wb.by_hash[engine_hash]

    def _unhold(self, worker: str, key: int, media: int) -> int:
        """Clear `media` bits of `worker` on `key`; returns the bits it still holds."""
        holders = self._blocks.get(key)
        if holders is None:
            return 0
        held = holders.get(worker)
        left = 0 if held is None else held[0] & ~media
        if left:
            holders[worker] = (left, held[1])  # type: ignore[index]
            return left
        holders.pop(worker, None)
        if not holders:
            del self._blocks[key]
        return 0

    def drop_worker(self, worker: str) -> None:
        """Forget everything `worker` holds (cleared, restarted, gone, out of sync)."""
        wb = self._workers.pop(worker, None)
        if wb is None:
            return
        for key in set(wb.by_hash.values()):
            self._unhold(worker, key, 7)

    # ---- lookups ----------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """The chain of block keys of `tokens` (whole blocks only). A chat's ids from the
        router's tokenizer carry them, keyed once per conversation prefix
        (shared/prompt_ids.py): a new turn keys only the blocks it adds."""
        carried = getattr(tokens, "block_keys", None)
        if carried is not None:
            return carried(self.block_size)  # type: ignore[no-any-return]
        ids = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        return block_key_list(ids, self.block_size)

    def match(self, tokens: Sequence[int] | np.ndarray) -> dict[str, int]:
        """Per worker, how many leading tokens of `tokens` it holds (whole blocks, > 0).

        By bisection over the block chain, a few dict look-ups per holder of the first
        block instead of one per block: an engine holds a block only with its parent and
        evicts leaves first, so what a worker holds of a chain is a prefix of it."""
        keys = self.keys(tokens)
        blocks = self._blocks
        first = blocks.get(keys[0]) if keys else None
        if not first:
            return {}
        out: dict[str, int] = {}
        for w in first:
            lo, hi = 1, len(keys)  # w holds keys[:lo]; the run ends at or before hi
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if w in blocks.get(keys[mid - 1], ()):
                    lo = mid
                else:
                    hi = mid - 1
            out[w] = lo * self.block_size
        return out

    def blocks_of(self, worker: str) -> int:
        wb = self._workers.get(worker)
        return 0 if wb is None else len(wb.by_hash)

    def holds(self, worker: str, key: int) -> bool:
        return worker in self._blocks.get(key, ())

    def __len__(self) -> int:
        return len(self._blocks)
