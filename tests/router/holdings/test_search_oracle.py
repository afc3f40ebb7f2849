"""The index's search started at a hint and the window read at each holder's deepest entry
answer as the code they replaced: main 2b35cc5's `_run` (a bisection from scratch) and its
`in_flight_window` (every entry of the path read), kept here as the oracle, side by side
over random indexes, real trees and their match paths.

- `BlockIndex._run(..., near)`: galloping from `near` finds the same run as the bisection
  wherever what a worker holds of the chain is a prefix of it (an engine holds a block
  only with its parent and evicts leaves first: the premise the bisection rests on);
  where it is not (a block in the middle removed), both answers are an end of a held
  stretch, the bisection's and the gallop's maybe different ones.
- `in_flight_window(..., monotone=True)`: over the paths of a tree whose times never went
  back (`PrefixTree.monotone`), the same four answers, each dict in the same order (since
  9e7b27e a path whose holders differ is read holder by holder, each at its deepest entry
  and its deepest in the window, both found by a search: merge.py's `_by_holder`).
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.holdings.kv_index import DEVICE, BlockIndex
from router.holdings.merge import Path, in_flight_window
from router.holdings.tree import PrefixTree
from shared.tokens.prompt_ids import KEY_WIDTH, token_key
from shared.wire.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

BS = 4
WORKERS = ("w0", "w1", "w2")


# ---- 2b35cc5's code, the oracle --------------------------------------------------------
def old_run(
    index: BlockIndex, worker: str, keys: list[int], lo: int, hi: int, media: int = 7
) -> int:
    blocks = index._blocks
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if (blocks.get(keys[mid - 1]) or {}).get(worker, (0, 0))[0] & media:
            lo = mid
        else:
            hi = mid - 1
    return lo


def old_match_tiers(index: BlockIndex, tokens: list[int]) -> dict[str, tuple[int, int]]:
    keys = index.keys(tokens)
    first = index._blocks.get(keys[0]) if keys else None
    if not first:
        return {}
    out = {}
    for w in first:
        held = old_run(index, w, keys, 1, len(keys))
        if index._blocks[keys[held - 1]][w][0] & DEVICE:
            on_device = held
        else:
            on_device = old_run(index, w, keys, 0, held - 1, DEVICE)
        out[w] = (on_device * BS, held * BS)
    return out


def old_in_flight_window(path: Path, trusted, cutoff: float) -> tuple:  # type: ignore[no-untyped-def]
    best: dict = {}
    past: dict = {}
    fresh: dict = {}
    changed = False
    for holders, end in path:
        for w, used in holders.items():
            if trusted(w):
                if used < cutoff:
                    past[w] = end
                    changed = True
                    continue
                fresh[w] = end
            best[w] = end
    return best, past, fresh, changed


# ---- the search from a hint ------------------------------------------------------------
def engine_like(rng: random.Random) -> tuple[BlockIndex, list[list[int]]]:
    """An index fed as engines feed it: each worker stores prompts (whole chains from the
    root, some on the host tier, some blocks again in another tier) and evicts leaves
    first (a chain's blocks from some point on, deepest first), so what it holds of any
    chain is a prefix of it."""
    index = BlockIndex(BS, max_lost=64)
    base = [rng.randrange(1, 40) for _ in range(BS * 24)]
    prompts = [base[: BS * rng.randrange(0, 25)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 40))]
               for _ in range(6)]  # fmt: skip
    for _ in range(rng.randrange(1, 30)):
        w, prompt = rng.choice(WORKERS), rng.choice(prompts)
        n = len(prompt) // BS
        if not n:
            continue
        hs = tuple(hash((w, *prompt[: BS * (i + 1)])) & 0xFFFFFFFF for i in range(n))
        if rng.random() < 0.7:
            index.apply(
                w,
                [BlockStored(hs, None, prompt[: n * BS], BS, rng.choice((None, None, MEDIUM_CPU)))],
            )
        else:  # the blocks from one on go, with every chain that hangs below them
            cut = rng.randrange(n)
            stem = prompt[: BS * (cut + 1)]
            for other in prompts:
                m = len(other) // BS
                if m > cut and other[: BS * (cut + 1)] == stem:
                    gone = tuple(
                        hash((w, *other[: BS * (i + 1)])) & 0xFFFFFFFF for i in range(cut, m)
                    )
                    index.apply(w, [BlockRemoved(gone[::-1], None)])
    return index, prompts


def prefix_closed(index: BlockIndex, worker: str, keys: list[int], media: int) -> bool:
    held = [bool(index.media_of(worker, k) & media) for k in keys]
    gap = held.index(False) if False in held else len(held)
    return not any(held[gap:])


CHECKED: list = []  # requests compared (the premise held), for a look at the coverage
HINTS = st.lists(
    st.one_of(st.none(), st.integers(0, 200), st.floats(0.0, 200.0)), min_size=3, max_size=3
)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), hints=HINTS)
def test_a_search_from_any_hint_finds_the_bisection_s_run(seed: int, hints: list) -> None:
    """Prefix-closed holdings (as engines leave them), any hint (none, 0, inside the
    chain, past its end, fractional): the same tiers as the bisection from scratch."""
    rng = random.Random(seed)
    index, prompts = engine_like(rng)
    given_hints = {w: h for w, h in zip(WORKERS, hints, strict=True) if h is not None}
    for request in prompts + [prompts[0][: BS * k] for k in range(1, 6)]:
        keys = index.keys(request)
        if not all(prefix_closed(index, w, keys, m) for w in WORKERS for m in (7, DEVICE)):
            continue  # (not as an engine leaves it: the next test's case)
        CHECKED.append(request)
        assert index.match_tiers(request, given_hints) == old_match_tiers(index, request)


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.booleans(), min_size=1, max_size=70), near=st.integers(-3, 80),
       prefix=st.booleans())  # fmt: skip
def test_the_gallop_ends_where_a_held_stretch_ends(
    held: list[bool], near: int, prefix: bool
) -> None:
    """Any holdings of a chain, the first block held: the search from any hint ends at the
    end of a held stretch (block `r` held, `r + 1` not or past the chain); where the
    holdings are a prefix, at the bisection's answer."""
    held[0] = True
    if prefix:
        held = sorted(held, reverse=True)
    index = BlockIndex(BS)
    keys = list(range(101, 101 + len(held)))
    for k, h in zip(keys, held, strict=True):
        if h:
            index._blocks[k] = {"w": (1, k)}
    got = index._run("w", keys, 1, len(keys), 7, near)
    assert held[got - 1] and (got == len(keys) or not held[got])
    if prefix:
        assert got == old_run(index, "w", keys, 1, len(keys)) == held.count(True)


# ---- the window at each holder's deepest entry -----------------------------------------
def monotone_tree(rng: random.Random) -> tuple[PrefixTree, list[list[int]], float]:
    """A real tree on ids, routes at times that never go back (some equal), small caps so
    inserts evict, prompts that share prefixes and split nodes."""
    tree: PrefixTree = PrefixTree(width=KEY_WIDTH)  # type: ignore[type-arg]
    for w in WORKERS:
        if rng.random() < 0.4:
            tree.set_cap(w, rng.randrange(6, 60))
    base = [rng.randrange(1, 30) for _ in range(30)]
    prompts = [base[: rng.randrange(0, 30)] + [rng.randrange(1, 30) for _ in range(rng.randrange(0, 12))]
               for _ in range(8)]  # fmt: skip
    prompts = [p for p in prompts if p] or [[1]]
    now = 0.0
    for _ in range(rng.randrange(0, 40)):
        now += rng.choice((0.0, 0.1, 0.5, 3.0))
        tree.insert(token_key(rng.choice(prompts)), rng.choice(WORKERS), now)  # type: ignore[arg-type]
    return tree, prompts, now


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), trust=st.sets(st.sampled_from(WORKERS)),
       window=st.sampled_from((0.0, 0.3, 1.0, 2.0, 5.0, 100.0, math.nan)))  # fmt: skip
def test_the_window_of_a_monotone_tree_answers_as_the_loop_did(
    seed: int, trust: set, window: float
) -> None:
    """Every request's path through a tree whose times never went back: the same best,
    past, fresh (in order) and flag as the loop over every entry."""
    rng = random.Random(seed)
    tree, prompts, now = monotone_tree(rng)
    assert tree.monotone
    tree.check_integrity()
    for request in prompts + [[*p, 99] for p in prompts]:
        path = tree.match_path(token_key(request))  # type: ignore[arg-type]
        cutoff = now - window
        new = in_flight_window(path, trust.__contains__, cutoff, monotone=True)
        old = old_in_flight_window(path, trust.__contains__, cutoff)
        assert [list(d.items()) for d in new[:3]] == [list(d.items()) for d in old[:3]]
        assert new[3] == old[3]


def test_a_tree_whose_times_went_back_is_no_longer_monotone() -> None:
    """An insert at an earlier time (a test's clock, a replica's) or at NaN ends it: the
    window then reads every entry."""
    tree: PrefixTree = PrefixTree()  # type: ignore[type-arg]
    tree.insert("hello world", "a", now=2.0)
    tree.insert("hello there", "b", now=2.0)
    assert tree.monotone
    tree.insert("hello", "a", now=1.0)
    assert not tree.monotone
    nan_tree: PrefixTree = PrefixTree()  # type: ignore[type-arg]
    nan_tree.insert("hi", "a", now=math.nan)
    assert not nan_tree.monotone
