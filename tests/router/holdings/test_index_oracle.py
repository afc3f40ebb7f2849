"""The index's rewritten rules answer as the rules they replaced: the old code, kept here
as the oracle, and the index side by side over random event streams and requests.

`OracleIndex` is `BlockIndex` with `_stored`, `_removed` and the lost book as main 8f87eb0
had them (before the store loop keyed blocks in line and set a new engine hash in one
look-up, the removal loop dropped a sole holder's block in one delete and took no copies'
look-ups from a worker with none (`_removed_copies`), and the lost book
became two generations of int keys: it was an LRU OrderedDict of (worker, key) tuples
trimmed to exactly `max_lost`); `old_lost_since_routed` is merge.py's rule before it
bisected the path. Every batch leaves both indexes with the same books, in the same order
(blocks' LRU order, each worker's engine hashes), and every lookup answers the same; the
lost book knows every loss the old one knows, at the same time, and at most twice
`max_lost` and the batch's blocks (`lost_at` answers as the old one wherever the old one
knows a loss)."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    """The store and removal loops and the lost book as main 8f87eb0 had them."""

    def __init__(self, block_size: int, max_blocks: int, max_lost: int) -> None:
        super().__init__(block_size, max_blocks, max_lost)
        self._lost: OrderedDict[tuple[str, int], float] = OrderedDict()  # type: ignore[assignment]

    def lost_at(self, worker: str, tokens: Sequence[int] | np.ndarray, held: int) -> float:
        keys = self.keys(tokens)
        i = held // self.block_size
        if i >= len(keys):
            return float("-inf")
        return self._lost.get((worker, keys[i]), float("-inf"))  # type: ignore[call-overload]

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
    """Everything the index keeps but the lost book, in order."""
    workers = {w: (list(wb.by_hash.items()), sorted(wb.extra.items()))
               for w, wb in index._workers.items()}  # fmt: skip
    return (list(index._blocks.items()), workers, index.orphans, index.forgotten,
            index.over_share)  # fmt: skip


def lost_book(index: BlockIndex) -> dict[tuple[str, int], float]:
    """The new index's lost book as the old one's: (worker, key) -> when it was lost."""
    worker_of = {base >> 64: w for w, base in index._lost_base.items()}
    out = {}
    for book in (index._lost_before, index._lost):  # the newer generation wins
        for key, at in book.items():
            out[(worker_of[key >> 64], key & (2**64 - 1))] = at
    return out


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
    check_against_the_oracle(seed)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**64))
def test_the_index_keeps_the_old_books_and_answers_any_seed(seed: int) -> None:
    check_against_the_oracle(seed)


def check_against_the_oracle(seed: int) -> None:
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
        assert len(new) == len(old)
        lost, known = lost_book(new), dict(old._lost)
        assert known.items() <= lost.items()  # every loss the old book knows, at its time
        batch = sum(len(getattr(e, "block_hashes", ())) for e in events)
        assert len(lost) <= 2 * (new.max_lost + batch)
        for chain in chains:
            assert new.match_tiers(chain) == old.match_tiers(chain)
            for w in ("w0", "w1", "w2"):
                for held in range(0, len(chain), BS):
                    at = old.lost_at(w, chain, held)
                    if at != float("-inf"):  # (else: a loss the old book had let go, or none)
                        assert new.lost_at(w, chain, held) == at
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


def test_the_lost_book_stays_bounded_as_workers_come_and_go() -> None:
    """Workers that lost blocks and left: their losses go with the book's turns, and so do
    their places in it (`_lost_base`), while a worker still here keeps its own."""
    index = BlockIndex(BS, max_lost=16)
    ids = list(range(1, 2 * BS + 1))
    for n in range(500):
        w = f"w{n}"
        index.apply(w, [BlockStored((1, 2), None, ids, BS), BlockRemoved((2, 1))], float(n))
        index.drop_worker(w)
        assert len(index._lost) + len(index._lost_before) <= 2 * 16 + 2
        assert len(index._lost_base) <= 2 * len(index._workers) + 8 + 16
        lost_book(index)  # every loss still names its worker
        for m in range(max(0, n - 7), n + 1):  # the last 16 losses: the last 8 workers'
            assert index.lost_at(f"w{m}", ids, 0) == index.lost_at(f"w{m}", ids, BS) == m
    assert index.lost_at("w499", ids, 0) == 499.0 and index.lost_at("w0", ids, 0) == float("-inf")
    index.apply("w0", [BlockStored((1, 2), None, ids, BS), BlockRemoved((2,))], 500.0)
    assert index.lost_at("w0", ids, BS) == 500.0 and index.lost_at("w0", ids, 0) == float("-inf")
