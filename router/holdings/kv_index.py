"""The exact index: which workers hold which token blocks, from their own KV events.

Beside the approximate prefix tree (router/holdings/tree.py: what this router *sent*), the index
says what each worker *reports* holding (shared/wire/kv_events.py). One index per model and
block size. A block is keyed by its content and its parent's key (`block_key_list`), never by
the engine's hash, so workers with different hash functions (vLLM's sha256, SGLang's,
ours) that hold the same tokens hold the same block:

    blocks   key -> {worker: (media bits, engine hash)}   (LRU order; `max_blocks`)
    per worker: engine hash -> key               (what a BlockRemoved names)

The media bits say which of a worker's tiers hold the block (GPU 1, CPU 2, STORAGE 4, as
the events name them; no medium: GPU): a BlockStored sets its medium's bit, a
BlockRemoved clears it, and the worker holds the block while any bit is set. So a
demotion (stored CPU, removed GPU) keeps the block as host-held, and a host eviction
after it drops it.

A lookup (`match`) keys the request's token blocks in turn and follows the holders of
each: a worker's score is its longest run of held blocks from the start, in tokens;
`match_tiers` also says how much of that run its device holds (router/holdings/merge.py
values the rest below a device hit: it is loaded, not computed).

When a worker stopped holding a block (BlockRemoved) is kept for a while (`lost_at`: the
blocks of at least the last `max_lost` losses, of at most twice as many and a batch; a
clear is not one: our engine's periodic republish starts with one): scoring needs it to
tell a route's blocks still on their way from blocks that arrived and were evicted since
(router/holdings/merge.py).

Bounded memory: past `max_blocks` the least recently stored blocks are forgotten for
every holder (an under-estimate, never a wrong holder). Each worker also has a share
(`shares`, set by router/holdings/kv_feed.py): past it, that worker's oldest stored blocks are
forgotten for it alone (`over_share`), so one worker's stream cannot push the others'
blocks out of the index. A BlockStored whose parent the
index does not know (forgotten, or stored before a gap) cannot be keyed and is dropped
(counted as `orphan`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.tokens.prompt_ids import PromptIds
from shared.wire.kv_events import (
    _MASK64,
    ID_CHARS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_key_list,
    block_key_text,
    ids_text,
)

_MEDIA = {None: 1, MEDIUM_GPU: 1, MEDIUM_CPU: 2, "STORAGE": 4}
DEVICE = 1  # the media bit of a device-held block
_BITS = (1, 2, 4)
# `_run`'s look-up of a block no worker holds, and of a worker that does not hold it.
_NO_HOLDERS: dict[str, tuple[int, int]] = {}
_NOT_HELD = (0, 0)


@dataclass
class _WorkerBlocks:
    by_hash: dict[BlockHash, int] = field(default_factory=dict)  # engine hash -> key
    # Stores not yet removed beyond the first, per engine hash and media bit: our engine
    # can hold one block in two tree nodes (below page granularity) and then reports it
    # stored twice, removed twice, in each tier (vLLM's offloading events say to count
    # them too). The first store is the media bit itself, so the common case (stored
    # once) costs no entry here: this stays empty for most workers.
    extra: dict[tuple[BlockHash, int], int] = field(default_factory=dict)

    def forget(self, engine_hash: BlockHash) -> None:
        self.by_hash.pop(engine_hash, None)
        extra = self.extra
        if extra:
            for bit in _BITS:
                extra.pop((engine_hash, bit), None)


class Dropping:
    """A worker's holder entries in one index, cleared `run` a step (`BlockIndex.dropping`).
    An iterator, not a generator: one left part-way goes on where it stopped."""

    def __init__(self, index: BlockIndex, worker: str, keys: list[int], run: int) -> None:
        self.index, self.worker, self.keys, self.run = index, worker, keys, run
        self.at = 0

    def __iter__(self) -> Dropping:
        return self

    def __next__(self) -> None:
        if self.at >= len(self.keys):
            raise StopIteration
        unhold, worker = self.index._unhold, self.worker
        for key in self.keys[self.at : self.at + self.run]:  # a key twice: unheld once
            unhold(worker, key, 7)
        self.at += self.run


class Freeing:
    """A whole index's blocks forgotten, `run` a step (`BlockIndex.freeing`): freeing a
    model's index of 100k+ blocks at once stalled a router for tens of ms."""

    worker = None  # (beside Dropping: no one worker)

    def __init__(self, index: BlockIndex, run: int) -> None:
        self.index, self.run = index, run

    def __iter__(self) -> Freeing:
        return self

    def __next__(self) -> None:
        blocks = self.index._blocks
        if not blocks:
            self.index._workers.clear()
            self.index._lost.clear()
            self.index._lost_before.clear()
            self.index._lost_base.clear()
            raise StopIteration
        for _ in range(min(self.run, len(blocks))):
            blocks.popitem()


class BlockIndex:
    """One model's blocks of `block_size` tokens -> their holders."""

    def __init__(
        self, block_size: int, max_blocks: int = 2_000_000, max_lost: int = 65_536
    ) -> None:
        if block_size < 1 or max_blocks < 1 or max_lost < 1:
            raise ValueError("block_size, max_blocks and max_lost must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_lost = max_lost
        # The lost book, in two generations: base | key -> when the worker last stopped
        # holding block `key`, since the book last turned over (`_lost`) and in the turn
        # before (`_lost_before`); it turns once `_lost` holds `max_lost` blocks (checked
        # once an event). A worker's base is its ordinal << 64 (`_lost_base`; keys are
        # 64-bit): a loss is one set of one int key. The LRU OrderedDict of (worker, key)
        # tuples it replaced was ~20% of the feed's apply on a real BPE tokenizer's stream
        # (a tuple, a membership test, a move and a trim a block).
        self._lost: dict[int, float] = {}
        self._lost_before: dict[int, float] = {}
        self._lost_base: dict[str, int] = {}  # worker -> its base in the lost book
        self._ordinals = itertools.count()
        self._now = 0.0  # the time of the batch being applied
        self._last: tuple[object, list[int]] = (None, [])  # the last lookup's keys
        # key -> holders, least recently stored first. An OrderedDict: a plain dict's
        # insertion order costs ~1k instructions less a block stored and removed (of
        # ~8.7k), but past max_blocks it finds its oldest key by a scan past the slots its
        # deletions left, up to its size, every event (40 us at 200k blocks).
        self._blocks: OrderedDict[int, dict[str, tuple[int, BlockHash]]] = OrderedDict()
        self._workers: dict[str, _WorkerBlocks] = {}
        self.orphans = 0  # stored blocks whose parent is unknown (dropped)
        self.forgotten = 0  # blocks dropped to stay under max_blocks
        self.shares: dict[str, int] = {}  # worker -> the most blocks it may hold (none: any)
        self.over_share = 0  # blocks forgotten for a worker past its share

    # ---- events -----------------------------------------------------------------
    def apply(self, worker: str, events: Sequence[KVEvent], now: float = 0.0) -> None:
        """Apply one batch of `worker`'s events (already validated by shared/wire/kv_events),
        read at `now` (the router's routing clock: what `lost_at` answers in)."""
        self._now = now
        for event in events:
            # By exact type (the events are final classes): an `isinstance` that fails
            # looks up the object's `__class__`, ~3x the instructions of `type(...) is`.
            kind = type(event)
            if kind is BlockStored:
                self._stored(worker, event)
            elif kind is BlockRemoved:
                self._removed(worker, event.block_hashes, _MEDIA.get(event.medium, 1))
            elif kind is AllBlocksCleared:
                self.drop_worker(worker)

    def _stored(self, worker: str, event: BlockStored) -> None:
        bs = self.block_size
        if event.block_size != bs:
            if event.block_size == 0:
                self._stored_again(worker, event)
                return
            raise ValueError(f"block size {event.block_size} is not the index's {bs}")
        wb = self._workers.get(worker)
        if wb is None:  # (not `setdefault`: that builds a _WorkerBlocks every event)
            wb = self._workers[worker] = _WorkerBlocks()
        if event.parent_block_hash is None:
            parent = 0
        else:
            known = wb.by_hash.get(event.parent_block_hash)
            if known is None:
                self.orphans += len(event.block_hashes)
                return
            parent = known
        media = _MEDIA.get(event.medium, 1)
        blocks, by_hash = self._blocks, wb.by_hash
        hashes = event.block_hashes
        text, ids = event.token_text, event.token_ids  # text: where the decoder packed it
        if text is None:
            ids = ids.tolist() if isinstance(ids, np.ndarray) else ids
            text = ids_text(ids)  # (None: ids that are no token ids)
        width = ID_CHARS * bs
        if text is None or len(text) != width * len(hashes):
            # Keyed apart (`block_key_list`), or key text that is no whole blocks (a
            # hand-built event): stored pair by pair as far as both go.
            keys = (
                block_key_list(ids, bs, parent)
                if text is None
                else block_key_text(text, bs, parent)
            )
            for key, engine_hash in zip(keys, hashes, strict=True):
                self._store(worker, wb, key, engine_hash, media)
        else:
            # `block_key_text` in line, each key made where its block is stored: no list
            # of keys and no call a block (the feed applies ~20-40 blocks a request). The
            # common block is one no worker holds (a turn's new blocks, a chat stored again
            # after its eviction), stored here; `_store` says the same for any block.
            # (Not `zip(hashes, range(...), strict=True)`: building it, keyword and all,
            # was ~10% of applying the live stream's events, ~2 blocks each.)
            mask, end = _MASK64, 0
            for engine_hash in hashes:  # (len(text) is `width` a hash: checked above)
                start, end = end, end + width
                parent = hash((parent, text[start:end])) & mask
                if parent in blocks:  # (`in`, not `get`: one bytecode, no call)
                    self._hold(worker, wb, parent, engine_hash, media, blocks[parent])
                    continue
                old = by_hash.setdefault(engine_hash, parent)
                if old is not parent and old != parent:  # (`is`: a new hash, at once)
                    self._unhold(worker, old, 7)
                    wb.forget(engine_hash)
                    by_hash[engine_hash] = parent
                blocks[parent] = {worker: (media, engine_hash)}
        share = self.shares.get(worker)
        if share is not None and len(by_hash) > share:
            self._shed(worker, wb, len(by_hash) - share)
        while len(blocks) > self.max_blocks:
            _, holders = blocks.popitem(last=False)
            self.forgotten += 1
            for w, (_, h) in holders.items():
                self._workers[w].forget(h)

    def _store(
        self, worker: str, wb: _WorkerBlocks, key: int, engine_hash: BlockHash, media: int
    ) -> None:
        """Block `key` stored by `worker` in `media` under `engine_hash`."""
        holders = self._blocks.get(key)
        if holders is not None:
            self._hold(worker, wb, key, engine_hash, media, holders)
            return
        by_hash = wb.by_hash
        # One look-up: a new engine hash goes in at once; one known for other content
        # goes (with its old block) and comes back at the end, as a plain set puts it.
        old = by_hash.setdefault(engine_hash, key)
        if old != key:
            self._unhold(worker, old, 7)
            wb.forget(engine_hash)
            by_hash[engine_hash] = key
        self._blocks[key] = {worker: (media, engine_hash)}

    def _hold(
        self, worker: str, wb: _WorkerBlocks, key: int, engine_hash: BlockHash, media: int,
        holders: dict[str, tuple[int, BlockHash]],
    ) -> None:  # fmt: skip
        """A stored block the index knows (`holders`): now held by `worker` in `media` too,
        and the most recently stored."""
        self._blocks.move_to_end(key)
        held = holders.get(worker)
        if held is None:
            bits = 0
        elif held[1] != engine_hash:
            wb.forget(held[1])  # the same content under a new engine hash
            bits = 0
        else:
            bits = held[0]
        by_hash = wb.by_hash
        old = by_hash.get(engine_hash)
        if old is not None and old != key:
            self._unhold(worker, old, 7)
            wb.forget(engine_hash)
        if bits & media:  # stored again in a tier that holds it: count the copy
            count = (engine_hash, media)
            wb.extra[count] = wb.extra.get(count, 0) + 1
        holders[worker] = (media | bits, engine_hash)
        by_hash[engine_hash] = key

    def _stored_again(self, worker: str, event: BlockStored) -> None:
        """A store by engine hash only (no tokens): blocks the worker named before, now in
        `event.medium` too; a hash it never named (or that was forgotten) is an orphan."""
        wb = self._workers.get(worker)
        media = _MEDIA.get(event.medium, 1)
        for engine_hash in event.block_hashes:
            key = None if wb is None else wb.by_hash.get(engine_hash)
            holders = None if key is None else self._blocks.get(key)
            held = None if holders is None else holders.get(worker)
            if held is None:
                self.orphans += 1
                continue
            if held[0] & media:  # type: ignore[index]
                count = (engine_hash, media)
                wb.extra[count] = wb.extra.get(count, 0) + 1  # type: ignore[union-attr]
            holders[worker] = (held[0] | media, held[1])  # type: ignore[index]

    def _removed(self, worker: str, hashes: Sequence[BlockHash], media: int) -> None:
        wb = self._workers.get(worker)
        if wb is None:
            return
        if wb.extra:  # (empty for most workers: a block stored once)
            self._removed_copies(worker, wb, hashes, media)
            return
        by_hash, blocks = wb.by_hash, self._blocks
        keep = ~media
        base = self._lost_base.get(worker)
        if base is None:
            base = self._lost_base[worker] = next(self._ordinals) << 64
        lost, now = self._lost, self._now
        for engine_hash in hashes:
            key = by_hash.get(engine_hash)
            if key is None:
                continue
            # _unhold, inlined: this loop runs for every block a worker evicts. Subscripts
            # in a `try`, not two `get`s: a worker's by_hash names blocks it holds, and a
            # subscript is one bytecode where a `get` is four and a call (with the copies'
            # checks out of this loop: 4.0k -> 3.2k instructions a block removed).
            try:
                holders = blocks[key]
                held = holders[worker]
            except KeyError:
                pass
            else:
                bits = held[0] & keep
                if bits:
                    holders[worker] = (bits, held[1])
                    continue
                if len(holders) == 1:  # its only holder (the common block): one delete
                    del blocks[key]
                else:
                    del holders[worker]
            del by_hash[engine_hash]  # held in no tier any more: `_WorkerBlocks.forget`
            lost[base | key if base else key] = now  # (the first worker's: no new int made)
        if len(lost) >= self.max_lost:
            self._turn_lost()

    def _removed_copies(
        self, worker: str, wb: _WorkerBlocks, hashes: Sequence[BlockHash], media: int
    ) -> None:
        """`_removed` for a worker that has stored a block more than once (`extra`): a
        removal takes a copy first."""
        extra, by_hash, blocks = wb.extra, wb.by_hash, self._blocks
        keep = ~media
        base = self._lost_base.get(worker)
        if base is None:
            base = self._lost_base[worker] = next(self._ordinals) << 64
        lost, now = self._lost, self._now
        for engine_hash in hashes:
            count = (engine_hash, media)
            left = extra.get(count, 0)
            if left:  # another copy of the block is still stored in that tier
                if left > 1:
                    extra[count] = left - 1
                else:
                    del extra[count]
                continue
            key = by_hash.get(engine_hash)
            if key is None:
                continue
            holders = blocks.get(key)
            held = None if holders is None else holders.get(worker)
            if held is not None:
                bits = held[0] & keep
                if bits:
                    holders[worker] = (bits, held[1])  # type: ignore[index]
                    continue
                if len(holders) == 1:  # type: ignore[arg-type]
                    del blocks[key]
                else:
                    del holders[worker]  # type: ignore[union-attr]
            wb.forget(engine_hash)
            lost[base | key if base else key] = now
        if len(lost) >= self.max_lost:
            self._turn_lost()

    def _turn_lost(self) -> None:
        """The book turns over: the generation before is forgotten. Every block lost in
        this generation or lost last in the one before is still known: at least the last
        `max_lost` losses' blocks."""
        self._lost_before, self._lost = self._lost, {}
        bases = self._lost_base
        if len(bases) > 2 * len(self._workers) + 8:  # workers gone: their bases may go
            kept = {key >> 64 for key in self._lost_before}
            self._lost_base = {w: b for w, b in bases.items() if b >> 64 in kept}

    def _shed(self, worker: str, wb: _WorkerBlocks, n: int) -> None:
        """Forget `worker`'s `n` oldest stored blocks (parents before children: the run
        a lookup finds only shortens)."""
        by_hash = wb.by_hash
        for engine_hash in list(itertools.islice(by_hash, n)):
            self._unhold(worker, by_hash[engine_hash], 7)
            wb.forget(engine_hash)
        self.over_share += n

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
        for _ in self.dropping(worker):
            pass

    def freeing(self, run: int = 4096) -> Freeing:
        """Forget every block, `run` a step (an index no longer used: a model no worker
        serves)."""
        return Freeing(self, run)

    def dropping(self, worker: str, run: int = 4096) -> Dropping:
        """`drop_worker` in steps of `run` blocks (~1 us each), for a caller that lets
        other work run between them (a worker's share can be 100k+ blocks: one call
        stalled a router ~0.1-1 s per rejoin). Its books go at once (`blocks_of` is 0);
        its holder entries a step at a time, so until the steps end `match` may still
        name it: the caller must not route on it, nor apply its events here, meanwhile."""
        wb = self._workers.pop(worker, None)
        return Dropping(self, worker, list(wb.by_hash.values()) if wb is not None else [], run)

    # ---- lookups ----------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """The chain of block keys of `tokens` (whole blocks only). A chat's ids from the
        router's tokenizer carry them, keyed once per conversation prefix
        (shared/tokens/prompt_ids.py): a new turn keys only the blocks it adds. The last
        request's are kept (by identity: callers do not mutate a request's ids), as
        scoring asks `match` and then `lost_at` about the same request."""
        last, keys = self._last
        if last is not tokens:
            if type(tokens) is PromptIds:  # (no bound method made: the common request)
                keys = tokens.block_keys(self.block_size)
            elif (carried := getattr(tokens, "block_keys", None)) is not None:
                keys = carried(self.block_size)
            else:
                ids = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
                keys = block_key_list(ids, self.block_size)
            self._last = (tokens, keys)
        return keys

    def lost_at(self, worker: str, tokens: Sequence[int] | np.ndarray, held: int) -> float:
        """When `worker` stopped holding the block of `tokens` after its first `held`
        tokens, as last applied; -inf: not known lost."""
        keys = self.keys(tokens)
        i = held // self.block_size
        base = self._lost_base.get(worker)
        if i >= len(keys) or base is None:
            return float("-inf")
        key = base | keys[i]
        at = self._lost.get(key)
        return at if at is not None else self._lost_before.get(key, float("-inf"))

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
        bs = self.block_size
        return {w: self._run(w, keys, 1, len(keys)) * bs for w in first}

    def match_tiers(
        self, tokens: Sequence[int] | np.ndarray, hints: Mapping[str, float] | None = None
    ) -> dict[str, tuple[int, int]]:
        """Per worker: (leading tokens of `tokens` its device holds, leading tokens it
        holds in any tier), whole blocks, the second > 0. `hints`: per worker, a guess
        of its held run in tokens (the scorer's tree end for it), where the search
        starts.

        Both runs by bisection, as in `match`: the device run is a prefix of the whole
        one (an engine's device residency is closed upwards: ours keeps a node on the
        device only under a device parent, vLLM offloads and evicts leaves first)."""
        keys = self.keys(tokens)
        blocks = self._blocks
        first = blocks.get(keys[0]) if keys else None
        if not first:
            return {}
        out: dict[str, tuple[int, int]] = {}
        bs = self.block_size
        for w in first:
            near = 0
            if hints:
                hint = hints.get(w)
                if hint:
                    near = int(hint) // bs
            held = self._run(w, keys, 1, len(keys), 7, near)
            # The device run is a prefix of the held one: where the held run's last block
            # is on the device, so is all of it (no host tier: every lookup), one look-up
            # instead of a second bisection.
            if blocks[keys[held - 1]][w][0] & DEVICE:
                on_device = held
            else:
                on_device = self._run(w, keys, 0, held - 1, DEVICE)
            out[w] = (on_device * bs, held * bs)
        return out

    def _run(
        self, worker: str, keys: list[int], lo: int, hi: int, media: int = 7, near: int = 0
    ) -> int:
        """How many of `keys` from the first `worker` holds (in a tier of `media`), known
        to be in [lo, hi]: a bisection, since what a worker holds of a chain is a prefix.

        With `near` in (lo, hi] (a guess of the answer), the search starts there and
        gallops away from it (steps of 1, 2, 4, ...) before bisecting what is left: a
        conversation's next turn holds what its tree end says, a block or two more (the
        answer) or a few less (events still on their way), so 2-5 probes instead of
        log2 of a ~130-block chain. The answer is the same wherever what the worker holds
        of the chain is a prefix of it, the premise the bisection rests on."""
        blocks = self._blocks
        if lo < near <= hi:
            step = 1
            if (blocks.get(keys[near - 1]) or _NO_HOLDERS).get(worker, _NOT_HELD)[0] & media:
                lo = near  # held there: the end is at or after it
                while lo < hi:
                    mid = lo + step
                    if mid > hi:
                        break
                    if (blocks.get(keys[mid - 1]) or _NO_HOLDERS).get(worker, _NOT_HELD)[0] & media:
                        lo = mid
                        step <<= 1
                    else:
                        hi = mid - 1
                        break
            else:
                hi = near - 1  # not held there: the end is before it
                while lo < hi:
                    mid = hi - step + 1
                    if mid <= lo:
                        break
                    if (blocks.get(keys[mid - 1]) or _NO_HOLDERS).get(worker, _NOT_HELD)[0] & media:
                        lo = mid
                        break
                    hi = mid - 1
                    step <<= 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            # (no holders, or not this worker: no media bits; two look-ups, no branches)
            if (blocks.get(keys[mid - 1]) or _NO_HOLDERS).get(worker, _NOT_HELD)[0] & media:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def media_of(self, worker: str, key: int) -> int:
        """The media bits of `worker` on block `key` (0: not held)."""
        held = self._blocks.get(key, {}).get(worker)
        return 0 if held is None else held[0]

    def blocks_of(self, worker: str) -> int:
        wb = self._workers.get(worker)
        return 0 if wb is None else len(wb.by_hash)

    def holds(self, worker: str, key: int) -> bool:
        return worker in self._blocks.get(key, ())

    def __len__(self) -> int:
        return len(self._blocks)
