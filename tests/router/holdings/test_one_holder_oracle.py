"""A conversation on its worker is scored as the code it replaced: main 9e7b27e's
`KvScorer.correct` (the window, then every rule in turn) and its index search, kept here
as the oracle, side by side over real trees, feeds and indexes.

Rewritten: `KvScorer.correct` takes a path whose one holder is in the window, on the tree
on ids, without `in_flight_window`'s pass, and where the index names that worker alone,
trusted and all on its device, answers without the rules' loop (`_one_holder`).
Compared: every output, dicts in their order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from router.holdings.kv_feed import KvEventFeed, StreamState
from router.holdings.kv_index import DEVICE, BlockIndex
from router.holdings.merge import (
    KvScorer,
    Path,
    confirmed_exact_end,
    evicting,
    host_weighted,
    in_flight_window,
    lost_since_routed,
)
from router.holdings.tree import PrefixTree
from shared.tokens.prompt_ids import KEY_WIDTH, token_key
from shared.wire.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

BS = 4


# ---- 9e7b27e's code, the oracle ------------------------------------------------------
class MainKvScorer(KvScorer):
    def correct(  # type: ignore[no-untyped-def]
        self, path, tokens, model, text_len, now, overflowed_at=None, monotone=False
    ):
        feed = self.feed
        detail = self.detail = {}
        count = len(tokens)
        if not feed.streams or not count:
            return path
        model = model or feed.only_model()
        trusted = feed.trusted
        cutoff = now - self.inflight
        best, past, fresh, changed = in_flight_window(path, trusted, cutoff, monotone)
        scale = text_len / count
        hints = best if scale == 1 else {w: e / scale for w, e in best.items()}
        index = feed.indexes.get(model)
        tiers = main_match_tiers(index, tokens, hints) if index is not None else {}
        streams = feed.streams  # (the feed's filter: no drops in these tests)
        tiers = {
            w: t
            for w, t in tiers.items()
            if (s := streams.get(w)) is not None and s.status in ("ok", "rebuilding")
        }
        if not (changed or tiers):
            return path
        self.corrected += 1
        block = feed.block_size(model)
        if fresh:
            for w in lost_since_routed(path, fresh, tiers, scale, block, feed, model, tokens):
                del best[w]
        weight = self.host_weight
        exact = scale == 1
        for w, (device, n) in tiers.items():
            if n == device:
                on_host = 1.0
                chars = on_device = min(text_len, n if exact else round(n * scale))
                host = 0
            else:
                on_host = host_weighted(n, device, weight, w)
                chars = min(text_len, round((device + on_host * (n - device)) * scale))
                on_device = min(text_len, round(device * scale))
                host = min(text_len, round(n * scale)) - on_device
            end = past.get(w, 0)
            if end:
                chars = confirmed_exact_end(chars, end, n, device, on_host, scale, block)
            if overflowed_at is not None and overflowed_at(w) >= cutoff and trusted(w):
                chars = evicting(chars, max(end, fresh.get(w, 0)))
            tree = best.get(w, 0)
            if chars > tree:
                best[w] = chars
            detail[w] = (on_device, host, "both" if tree or end else "index")
        if len(best) == 1:
            for w, e in best.items():
                return [({w: now}, int(e))]
        ends = sorted(set(best.values()))
        return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]


def main_match_tiers(
    index: BlockIndex, tokens: Sequence[int], hints: dict | None = None
) -> dict[str, tuple[int, int]]:
    keys = index.keys(tokens)
    blocks = index._blocks
    first = blocks.get(keys[0]) if keys else None
    if not first:
        return {}
    out = {}
    bs = index.block_size
    for w in first:
        near = 0
        if hints:
            hint = hints.get(w)
            if hint:
                near = int(hint) // bs
        held = index._run(w, keys, 1, len(keys), 7, near)
        if blocks[keys[held - 1]][w][0] & DEVICE:
            on_device = held
        else:
            on_device = index._run(w, keys, 0, held - 1, DEVICE)
        out[w] = (on_device * bs, held * bs)
    return out


def ordered(path: Path) -> list:
    return [(list(h.items()), e) for h, e in path]


# ---- conversations on their workers ---------------------------------------------------
class Counting(KvScorer):
    """The scorer under test, counting the requests its one-holder path answered."""

    answered = 0

    def _one_holder(self, *args):  # type: ignore[no-untyped-def]
        got = super()._one_holder(*args)
        Counting.answered += got is not None
        return got


def stored(w: str, ids: list[int], medium: str | None = None) -> BlockStored:
    n = len(ids) // BS
    hs = tuple(hash((w, *ids[: BS * (i + 1)])) & 0xFFFFFFFF for i in range(n))
    return BlockStored(hs, None, ids[: n * BS], BS, medium)


def removed(w: str, ids: list[int], start: int) -> BlockRemoved:
    n = len(ids) // BS
    hs = tuple(hash((w, *ids[: BS * (i + 1)])) & 0xFFFFFFFF for i in range(start, n))
    return BlockRemoved(hs[::-1], None)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 3))
def test_conversations_are_scored_as_they_were(seed: int, workers: int) -> None:
    """Chats that grow turn by turn, each routed to a worker that mostly keeps it, the
    worker's stores (and sometimes evictions, host tiers, lagging events) applied
    between turns, statuses, caps, windows and scales at random: every corrected path
    (holders in order), detail and count are the old code's."""
    rng = random.Random(seed)
    names = [f"w{i}" for i in range(workers)]
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # entries applied by hand
    index = feed.indexes["m"] = BlockIndex(BS, max_lost=rng.choice((4, 1000)))
    for w in names:
        status = rng.choice(("ok", "ok", "ok", "ok", "rebuilding", "stale"))
        feed.streams[w] = StreamState("m", 1.0, status=status)
    tree: PrefixTree = PrefixTree(width=KEY_WIDTH)  # type: ignore[type-arg]
    for w in names:
        if rng.random() < 0.5:
            tree.set_cap(w, rng.randrange(20, 200))
    inflight = rng.choice((0.3, 2.0, 100.0))
    weights = {w: rng.choice((0.0, 0.5, 1.0)) for w in names}
    new = Counting(feed, inflight, weights.__getitem__)
    old = MainKvScorer(feed, inflight, weights.__getitem__)
    chats = [([rng.randrange(1, 60) for _ in range(rng.randrange(1, 40))], rng.choice(names))
             for _ in range(rng.randrange(1, 4))]  # fmt: skip
    now = 0.0
    for _ in range(30):
        now += rng.choice((0.0, 0.1, 0.5, 1.0))
        i = rng.randrange(len(chats))
        prompt, w = chats[i]
        prompt = prompt + [rng.randrange(1, 60) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.15:
            w = rng.choice(names)  # the chat moves
        scale = rng.choice((1.0, 1.0, 1.0, 0.5))
        text_len = max(1, round(len(prompt) * scale))
        path = tree.match_path(token_key(prompt))  # type: ignore[arg-type]
        overflowed = rng.choice((tree.overflowed_at, tree.overflowed_at, None))
        model = rng.choice(("m", ""))
        got = new.correct(path, prompt, model, text_len, now, overflowed, tree.monotone)
        want = old.correct(path, prompt, "m", text_len, now, overflowed, tree.monotone)
        assert ordered(got) == ordered(want)
        assert list(new.detail.items()) == list(old.detail.items())
        assert new.corrected == old.corrected
        tree.insert(token_key(prompt), w, now)  # type: ignore[arg-type]
        answer = [rng.randrange(1, 60) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.8:  # the worker's events (sometimes a turn late: not yet)
            held = prompt + answer
            events = [stored(w, held, rng.choice((None, None, None, MEDIUM_CPU)))]
            if rng.random() < 0.2 and len(held) >= BS:  # evicted from some block on
                events.append(removed(w, held, rng.randrange(len(held) // BS)))
            # (lost after the route, or at its very time)
            index.apply(w, events, now + rng.choice((0.0, 0.05)))
        chats[i] = (prompt + answer, w)


def test_a_conversation_on_its_worker_takes_the_one_holder_path() -> None:
    """A chat on one trusted worker, its stores applied between turns: past its first
    turn every request is answered by the one-holder path, as the old code answers."""
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]
    index = feed.indexes["m"] = BlockIndex(BS)
    feed.streams["w0"] = StreamState("m", 1.0, status="ok")
    tree: PrefixTree = PrefixTree(width=KEY_WIDTH)  # type: ignore[type-arg]
    new, old = Counting(feed, 2.0), MainKvScorer(feed, 2.0)
    rng = random.Random(7)
    prompt = [rng.randrange(1, 60) for _ in range(37)]
    Counting.answered = 0
    for turn in range(10):
        prompt = prompt + [rng.randrange(1, 60) for _ in range(5)]
        path = tree.match_path(token_key(prompt))  # type: ignore[arg-type]
        got = new.correct(path, prompt, "", len(prompt), turn, tree.overflowed_at, tree.monotone)
        want = old.correct(path, prompt, "m", len(prompt), turn, tree.overflowed_at, True)
        assert ordered(got) == ordered(want)
        assert list(new.detail.items()) == list(old.detail.items())
        tree.insert(token_key(prompt), "w0", turn)  # type: ignore[arg-type]
        prompt = prompt + [rng.randrange(1, 60) for _ in range(3)]
        index.apply("w0", [stored("w0", prompt)], turn)
    assert Counting.answered == 9
