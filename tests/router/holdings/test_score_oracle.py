"""A request's KV scoring answers as the code it replaced: main ecd65ff's rules, kept here as
the oracle, against router/holdings/merge.py and the index's lookup, side by side over
random paths, real trees, real feeds and real indexes.

Rewritten: `in_flight_window` (every entry in the window: C passes over the path, the
trusted workers' entries read off `best`), `KvScorer.correct` (no `held` dict: the tiers
read in place; the named rules called where they can apply; `evicting`'s tests reordered),
`lost_since_routed` (takes the tiers), `BlockIndex._run` (one expression a probe).
Since 2b35cc5 also: the index's search started at each worker's tree end, the window read
at each holder's deepest entry where the tree's times never went back, `lost_at` asked
before the route's time (each rule alone: tests/router/holdings/test_search_oracle.py).
Compared: every output, dicts in their order (a policy reads the path's holders)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from router.holdings.kv_feed import KvEventFeed, StreamState
from router.holdings.kv_index import DEVICE, BlockIndex
from router.holdings.merge import (
    BlockHolders,
    KvScorer,
    Path,
    confirmed_exact_end,
    evicting,
    host_weighted,
    in_flight_window,
)
from router.holdings.tree import PrefixTree
from shared.tokens.prompt_ids import KEY_WIDTH, token_key
from shared.wire.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent

BS = 4
WORKERS = ("w0", "w1", "w2")


# ---- ecd65ff's code, the oracle ------------------------------------------------------
def old_in_flight_window(
    path: Path, trusted: Callable[[str], bool], cutoff: float
) -> tuple[dict, dict, dict, bool]:
    best: dict = {}
    past: dict = {}
    fresh: dict = {}
    changed = False
    trust: dict = {}
    for holders, end in path:
        for w, used in holders.items():
            t = trust.get(w)
            if t is None:
                t = trust[w] = trusted(w)  # type: ignore[arg-type]
            if t:
                if used < cutoff:
                    past[w] = end
                    changed = True
                    continue
                fresh[w] = end
            best[w] = end
    return best, past, fresh, changed


def old_lost_since_routed(
    path: Path, fresh: Mapping, held: Mapping, scale: float, block: int,
    feed: BlockHolders, model: str, tokens: Sequence[int],
) -> list:  # fmt: skip
    from bisect import bisect_right
    from itertools import islice
    from operator import itemgetter

    gone = []
    for w, end in fresh.items():
        n = held.get(w, 0)
        whole = int(end / scale) // block * block if block else 0
        if n >= whole:
            continue
        i = bisect_right(path, n * scale, key=itemgetter(1))
        routed = next(h[w] for h, _ in islice(path, i, None) if w in h)
        if feed.lost_at(model, tokens, w, n) > routed:
            gone.append(w)
    return gone


class OldKvScorer(KvScorer):
    def correct(self, path, tokens, model, text_len, now, overflowed_at=None):  # type: ignore[no-untyped-def]
        feed = self.feed
        self.detail = {}
        if not feed.streams or not len(tokens):
            return path
        model = model or feed.only_model()
        tiers = feed.match_tiers(model, tokens)
        held = {w: n for w, (_, n) in tiers.items()}
        trusted = feed.trusted
        cutoff = now - self.inflight
        best, past, fresh, changed = old_in_flight_window(path, trusted, cutoff)
        if not (changed or held):
            return path
        self.corrected += 1
        scale = text_len / len(tokens)
        block = feed.block_size(model)
        for w in old_lost_since_routed(path, fresh, held, scale, block, feed, model, tokens):
            del best[w]
        weight = self.host_weight
        for w, n in held.items():
            device = tiers[w][0]
            on_host = host_weighted(n, device, weight, w)
            chars = min(text_len, round((device + on_host * (n - device)) * scale))
            end = past.get(w, 0)
            chars = confirmed_exact_end(chars, end, n, device, on_host, scale, block)
            if overflowed_at is not None and trusted(w) and overflowed_at(w) >= cutoff:
                chars = evicting(chars, max(end, fresh.get(w, 0)))
            tree = best.get(w, 0)
            if chars > tree:
                best[w] = chars
            on_device = min(text_len, round(device * scale))
            self.detail[w] = (on_device, min(text_len, round(n * scale)) - on_device,
                              "both" if tree or end else "index")  # fmt: skip
        ends = sorted(set(best.values()))
        return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]


def old_match_tiers(index: BlockIndex, tokens: Sequence[int]) -> dict:
    def run(worker: str, keys: list[int], lo: int, hi: int, media: int = 7) -> int:
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            holders = index._blocks.get(keys[mid - 1])
            held = None if holders is None else holders.get(worker)
            if held is not None and held[0] & media:
                lo = mid
            else:
                hi = mid - 1
        return lo

    keys = index.keys(tokens)
    first = index._blocks.get(keys[0]) if keys else None
    if not first:
        return {}
    out = {}
    for w in first:
        held = run(w, keys, 1, len(keys))
        if index._blocks[keys[held - 1]][w][0] & DEVICE:
            on_device = held
        else:
            on_device = run(w, keys, 0, held - 1, DEVICE)
        out[w] = (on_device * BS, held * BS)
    return out


def ordered(path: Path) -> list:
    return [(list(h.items()), e) for h, e in path]


# ---- in_flight_window over any path ----------------------------------------------------
TIMES = st.one_of(st.floats(0.0, 10.0), st.sampled_from([math.nan, math.inf, -math.inf, 5.0]))
PATHS = st.lists(
    st.tuples(st.dictionaries(st.sampled_from(("a", "b", "c", "d")), TIMES, max_size=4),
              st.integers(1, 500)),
    max_size=12,
)  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(path=PATHS, trust=st.sets(st.sampled_from(("a", "b", "c", "d"))),
       cutoff=st.one_of(st.floats(0.0, 10.0), st.just(math.nan)))  # fmt: skip
def test_in_flight_window_answers_as_the_loop_did(path: Path, trust: set, cutoff: float) -> None:
    """Any path, NaN and infinite times and cutoffs, empty holders included: the same
    four answers, each dict in the same order."""
    new = in_flight_window(path, trust.__contains__, cutoff)
    old = old_in_flight_window(path, trust.__contains__, cutoff)
    assert [list(d.items()) for d in new[:3]] == [list(d.items()) for d in old[:3]]
    assert new[3] == old[3]


# ---- the whole scoring over real trees, feeds and indexes -----------------------------
def random_world(rng: random.Random) -> tuple[KvEventFeed, PrefixTree, list[list[int]], list]:
    """A real feed (statuses at random, an index fed stores, removals and host tiers) and a
    real tree (routes at random times, small caps so inserts overflow), on prompts that
    share prefixes; and the events to apply between requests."""
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # entries applied by hand
    feed.indexes["m"] = BlockIndex(BS, max_lost=rng.choice((4, 1000)))
    for w in WORKERS:
        status = rng.choice(("ok", "ok", "ok", "rebuilding", "lagging", "stale"))
        feed.streams[w] = StreamState("m", 1.0, status=status)
    tree: PrefixTree = PrefixTree(width=KEY_WIDTH)  # type: ignore[type-arg]
    for w in WORKERS:
        if rng.random() < 0.5:
            tree.set_cap(w, rng.randrange(8, 80))
    base = [rng.randrange(1, 50) for _ in range(BS * 8)]
    prompts = [base[: BS * rng.randrange(0, 9)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))]
               for _ in range(10)]  # fmt: skip
    return feed, tree, prompts, []


def events_for(rng: random.Random, prompt: list[int], w: str) -> list[KVEvent]:
    n = len(prompt) // BS * BS
    if not n:
        return []
    hs = tuple(hash((w, *prompt[: BS * (i + 1)])) & 0xFFFFFFFF for i in range(n // BS))
    medium = rng.choice((None, None, MEDIUM_CPU))
    events: list[KVEvent] = [BlockStored(hs, None, prompt[:n], BS, medium)]
    if rng.random() < 0.5:
        events.append(BlockRemoved(hs[rng.randrange(len(hs)) :], rng.choice((None, MEDIUM_CPU))))
    return events


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_scoring_answers_as_it_did(seed: int) -> None:
    """Every request's corrected path (holders in order), detail and count of corrected
    requests, for every window and for scales of the tree's units, are the old code's;
    and the index's tiers are the old bisection's."""
    rng = random.Random(seed)
    feed, tree, prompts, _ = random_world(rng)
    weights = {w: rng.choice((0.0, 0.5, 0.95, 1.0)) for w in WORKERS}
    inflight = rng.choice((0.0, 0.5, 2.0, 100.0))
    new = KvScorer(feed, inflight, weights.__getitem__)
    old = OldKvScorer(feed, inflight, weights.__getitem__)
    index = feed.indexes["m"]
    for step in range(40):
        now = step * 0.25
        prompt, w = rng.choice(prompts), rng.choice(WORKERS)
        if rng.random() < 0.5:
            tree.insert(token_key(prompt), w, now)  # type: ignore[arg-type]
        else:
            index.apply(w, events_for(rng, prompt, w), now)
        request = rng.choice(prompts)
        assert index.match_tiers(request) == old_match_tiers(index, request)
        path = tree.match_path(token_key(request))  # type: ignore[arg-type]
        scale = rng.choice((1.0, 1.0, 0.5, 2.3))
        text_len = max(1, round(len(request) * scale))
        overflowed = rng.choice((tree.overflowed_at, None))
        monotone = rng.random() < 0.5 and tree.monotone  # (the window at deepest entries)
        got = new.correct(path, request, rng.choice(("m", "")), text_len, now, overflowed, monotone)
        want = old.correct(path, request, "m", text_len, now, overflowed)
        assert ordered(got) == ordered(want)
        assert list(new.detail.items()) == list(old.detail.items())
        assert new.corrected == old.corrected
