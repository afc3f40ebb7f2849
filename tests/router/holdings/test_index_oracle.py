"""The index's rewritten rules answer as the rules they replaced: the old code, kept here
as the oracle, and the index side by side over random event streams and requests.

`OracleIndex` is `BlockIndex` with `_stored` and `_removed` as main 8f87eb0 had them
(before the store loop keyed blocks in line and set a new engine hash in one look-up, and
the removal loop dropped a sole holder's block in one delete and trimmed the lost book once
an event); `old_lost_since_routed` is merge.py's rule before it bisected the path. Every batch leaves both indexes with the same books, in the same order (blocks' LRU
order, each worker's engine hashes, the losses), and every lookup answers the same."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.holdings.kv_feed import KvEventFeed, StreamState
from router.holdings.kv_index import _MEDIA, BlockIndex, _WorkerBlocks
from router.holdings.merge import Path, in_flight_window, lost_since_routed
from router.holdings.tree import PrefixTree
from shared.tokens.prompt_ids import KEY_WIDTH, token_key
from shared.wire.kv_events import (
    MEDIUM_CPU,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_key_list,
    block_key_text,
    ids_text,
)

BS = 4


class OracleIndex(BlockIndex):
    """The store and removal loops as main 8f87eb0 had them."""

    def _stored(self, worker: str, event: BlockStored) -> None:
        bs = self.block_size
        if event.block_size == 0:
            self._stored_again(worker, event)
            return
        if event.block_size != bs:
            raise ValueError(f"block size {event.block_size} is not the index's {bs}")
        wb = self._workers.get(worker)
        if wb is None:
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
        blocks = self._blocks
        text = event.token_text
        if text is not None:
            keys = block_key_text(text, bs, parent)
        else:
            ids = event.token_ids
            keys = block_key_list(
                ids.tolist() if isinstance(ids, np.ndarray) else list(ids), bs, parent
            )
        by_hash = wb.by_hash
        for parent, engine_hash in zip(keys, event.block_hashes, strict=True):
            holders = blocks.get(parent)
            if holders is None:
                old = by_hash.get(engine_hash)
                if old is not None and old != parent:
                    self._unhold(worker, old, 7)
                    wb.forget(engine_hash)
                blocks[parent] = {worker: (media, engine_hash)}
                by_hash[engine_hash] = parent
                continue
            blocks.move_to_end(parent)
            held = holders.get(worker)
            if held is None:
                bits = 0
            elif held[1] != engine_hash:
                wb.forget(held[1])
                bits = 0
            else:
                bits = held[0]
            old = by_hash.get(engine_hash)
            if old is not None and old != parent:
                self._unhold(worker, old, 7)
                wb.forget(engine_hash)
            if bits & media:
                count = (engine_hash, media)
                wb.extra[count] = wb.extra.get(count, 0) + 1
            holders[worker] = (media | bits, engine_hash)
            by_hash[engine_hash] = parent
        share = self.shares.get(worker)
        if share is not None and len(by_hash) > share:
            self._shed(worker, wb, len(by_hash) - share)
        while len(blocks) > self.max_blocks:
            _, holders = blocks.popitem(last=False)
            self.forgotten += 1
            for w, (_, h) in holders.items():
                self._workers[w].forget(h)

    def _removed(self, worker: str, hashes: tuple[BlockHash, ...], media: int) -> None:
        wb = self._workers.get(worker)
        if wb is None:
            return
        extra, by_hash, blocks = wb.extra, wb.by_hash, self._blocks
        lost, now = self._lost, self._now
        for engine_hash in hashes:
            if extra:
                count = (engine_hash, media)
                left = extra.get(count, 0)
                if left:
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
                bits = held[0] & ~media
                if bits:
                    holders[worker] = (bits, held[1])
                    continue
                del holders[worker]
                if not holders:
                    del blocks[key]
            del by_hash[engine_hash]
            if extra:
                for bit in (1, 2, 4):
                    extra.pop((engine_hash, bit), None)
            lost_key = (worker, key)
            if lost_key in lost:
                lost.move_to_end(lost_key)
            lost[lost_key] = now
            if len(lost) > self.max_lost:
                lost.popitem(last=False)


def books(index: BlockIndex) -> tuple:
    """Everything the index keeps, in order."""
    workers = {w: (list(wb.by_hash.items()), sorted(wb.extra.items()))
               for w, wb in index._workers.items()}  # fmt: skip
    return (list(index._blocks.items()), workers, list(index._lost.items()), index.orphans,
            index.forgotten, index.over_share)  # fmt: skip


def random_events(rng: random.Random, chains: list[list[int]], hashes: dict) -> list[KVEvent]:
    """A batch: stores along a few shared chains (new, again, in another tier, under a new
    engine hash, an engine hash known for other content, by hash only, with or without
    key text, as arrays, ids that are no token ids, orphans), removals (of held, unknown
    and partly held blocks, per tier)."""
    events: list[KVEvent] = []
    for _ in range(rng.randrange(1, 5)):
        chain = rng.choice(chains)
        if rng.random() < 0.6:
            start = rng.randrange(0, len(chain) // BS)
            n = rng.randrange(1, len(chain) // BS - start + 1)
            ids = chain[start * BS : (start + n) * BS]
            salt = rng.choice((0, 0, 0, 1))  # now and then the same block, another hash
            hs = tuple(hashes.setdefault((id(chain), start + i, salt), rng.getrandbits(40))
                       for i in range(n))  # fmt: skip
            if hashes and rng.random() < 0.1:  # an engine hash named before, other content
                hs = (*hs[:-1], rng.choice(list(hashes.values())))
            parent = None
            if start:
                parent = hashes.get((id(chain), start - 1, 0), rng.getrandbits(40))
            if rng.random() < 0.05:
                parent = rng.getrandbits(40)  # unknown: an orphan
            medium = rng.choice((None, "GPU", "GPU", MEDIUM_CPU))
            text = ids_text(ids) if rng.random() < 0.8 else None
            if rng.random() < 0.05 and text:
                text = text[: len(text) - 4]  # key text short of the ids (hand-built)
            if text is None and rng.random() < 0.3:  # the simulator's arrays; no token ids
                ids = np.array(ids) if rng.random() < 0.5 else [-ids[0], *ids[1:]]
            if rng.random() < 0.07:
                events.append(BlockStored(hs, None, [], 0, medium))  # by hash only
            else:
                events.append(BlockStored(hs, parent, ids, BS, medium, None, None, text))
        else:
            known = list(hashes.values())
            hs = tuple(rng.choice(known) if known and rng.random() < 0.9 else rng.getrandbits(40)
                       for _ in range(rng.randrange(1, 6)))  # fmt: skip
            events.append(BlockRemoved(hs, rng.choice((None, "GPU", MEDIUM_CPU))))
    return events


@pytest.mark.parametrize("seed", range(40))
def test_the_index_keeps_the_old_books_and_answers(seed: int) -> None:
    rng = random.Random(seed)
    sizes = dict(max_blocks=rng.choice((12, 40, 2_000)), max_lost=rng.choice((5, 30, 1_000)))
    new, old = BlockIndex(BS, **sizes), OracleIndex(BS, **sizes)
    shares = {"w0": rng.choice((8, 1_000)), "w1": 1_000}
    new.shares, old.shares = dict(shares), dict(shares)
    chains = [[rng.randrange(1, 60) for _ in range(BS * rng.randrange(2, 9))] for _ in range(4)]
    chains.append(chains[0][: 2 * BS] + chains[1][2 * BS :])  # a shared prefix
    hashes: dict = {}
    for step in range(60):
        worker = rng.choice(("w0", "w1", "w2"))
        events = random_events(rng, chains, hashes)
        outcomes = []
        for index in (new, old):
            try:
                index.apply(worker, events, float(step))
                outcomes.append(None)
            except ValueError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]
        assert books(new) == books(old)
        for chain in chains:
            assert new.match_tiers(chain) == old.match_tiers(chain)
            for w in ("w0", "w1", "w2"):
                for held in range(0, len(chain), BS):
                    assert new.lost_at(w, chain, held) == old.lost_at(w, chain, held)
                assert new.blocks_of(w) == old.blocks_of(w)


def old_lost_since_routed(
    path: Path, fresh: dict, held: dict, scale: float, block: int, feed: KvEventFeed,
    model: str, tokens: list[int],
) -> list[object]:  # fmt: skip
    """merge.py's rule before it bisected the path: a scan from the root."""
    gone = []
    for w, end in fresh.items():
        n = held.get(w, 0)
        whole = int(end / scale) // block * block if block else 0
        if n >= whole:
            continue
        at = n * scale
        routed = next(h[w] for h, e in path if e > at and w in h)
        if feed.lost_at(model, tokens, w, n) > routed:
            gone.append(w)
    return gone


@pytest.mark.parametrize("seed", range(30))
def test_lost_since_routed_answers_as_the_scan_did(seed: int) -> None:
    """Real trees (routes at random times to three workers, chats that share prefixes) and
    a real feed whose index stored and lost blocks at random times: for every request
    and every window, the rule names the same workers as the old scan."""
    rng = random.Random(seed)
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # entries applied by hand
    index = feed.indexes["m"] = BlockIndex(BS)
    workers = ("w0", "w1", "w2")
    for w in workers:
        feed.streams[w] = StreamState("m", 1.0, status="ok")
    tree: PrefixTree = PrefixTree(width=KEY_WIDTH)  # type: ignore[type-arg]
    base = [rng.randrange(1, 50) for _ in range(BS * 6)]
    prompts = [base[: BS * rng.randrange(1, 7)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 13))]
               for _ in range(12)]  # fmt: skip
    for step in range(80):
        now = step * 0.25
        prompt, w = rng.choice(prompts), rng.choice(workers)
        if rng.random() < 0.5:
            tree.insert(token_key(prompt), w, now)  # type: ignore[arg-type]
        else:
            n = len(prompt) // BS * BS
            if n:
                hs = tuple(hash((w, *prompt[: BS * (i + 1)])) for i in range(n // BS))
                events: list[KVEvent] = [BlockStored(hs, None, prompt[:n], BS)]
                if rng.random() < 0.6:
                    events.append(BlockRemoved(hs[rng.randrange(len(hs)) :]))
                index.apply(w, events, now)
        request = rng.choice(prompts)
        path = tree.match_path(token_key(request))  # type: ignore[arg-type]
        for cutoff in (now - 0.5, now - 3.0):
            _, _, fresh, _ = in_flight_window(path, feed.trusted, cutoff)
            tiers = feed.match_tiers("m", request)
            held = {w: n for w, (_, n) in tiers.items()}
            rest = (1.0, BS, feed, "m", request)
            assert lost_since_routed(path, fresh, tiers, *rest) == old_lost_since_routed(
                path,
                fresh,
                held,
                *rest,  # type: ignore[arg-type]
            )
