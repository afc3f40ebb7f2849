"""How the tree and the KV-event index merge into one prediction: five named rules.

The tree (router/holdings/tree.py) records what this router sent each worker, when; the
index (router/holdings/kv_feed.py) what each worker reports holding. `KvScorer.correct`
takes the tree's match path and returns one in the same shape (holders, end in the tree's
units, root side first), so the policies' rules run unchanged. Index tokens become the
tree's units at the request's own chars per token (1 where the tree keys on ids).

The rules, in the order they apply; each names the incident it fixes and the test that
replays it:

- `in_flight_window`: a trusted worker's tree entry counts only while it is in flight.
- `lost_since_routed`: an in-flight entry whose blocks arrived and were evicted since.
- `host_weighted`: a host-held token is worth `host_weight(w)` of a device-held one.
- `confirmed_exact_end`: an older entry the index confirms keeps its exact end.
- `evicting`: a worker the routes just overflowed is about to evict what the index shows.

After the merge the room applies one more, learned from answers rather than events:
`unconfirmed_claims` (router/holdings/claims.py).

A worker that is not trusted (stale epoch, lagging, no events) keeps its tree match; a
rebuilding one (events lost, router/holdings/feed_entries.py) keeps it and adds its index's.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from operator import itemgetter
from typing import Protocol

from shared.wire.registry import WorkerRecord

Path = list[tuple[Mapping[object, float], int]]
_end = itemgetter(1)  # a path entry's end
_NEVER = float("-inf")  # `lost_at`'s answer for a block not known lost

# A host-held token's worth against a device-held one when the worker reports no host
# load figures: between a miss (0) and a hit (1); the measured CPU engine loads ~100x
# faster than it prefills, a GPU worker ~6-20x (loadtests/results/host_tier.md), so any
# real figure is above this; unknown, the router only prefers a device copy.
HOST_HIT_WEIGHT = 0.5
_MAX_US = 1e6  # a figure above 1 s a token is garbage: heartbeats are untrusted


def host_hit_weight(report: WorkerRecord | None, prefill_us_default: float) -> float:
    """The share of a token's prefill that loading it from `report`'s host tier saves."""
    if report is None:
        return HOST_HIT_WEIGHT
    rate, size = report.host_load_bytes_per_s, report.kv_bytes_per_token
    prefill = report.prefill_us_per_token
    if not _number(prefill, _MAX_US) or prefill <= 0:
        prefill = prefill_us_default
    if not (_number(rate, 1e15) and rate > 0 and _number(size, 1e9) and size > 0):
        return HOST_HIT_WEIGHT
    return max(0.0, 1.0 - size / rate * 1e6 / prefill)


def _number(value: object, high: float) -> bool:
    return isinstance(value, int | float) and 0 <= value <= high  # NaN fails both


def _any_weight(_wid: str) -> float:
    return HOST_HIT_WEIGHT


class BlockHolders(Protocol):
    """What scoring reads of the KV-event feed (router/holdings/kv_feed.py's KvEventFeed)."""

    @property
    def streams(self) -> Mapping[str, object]: ...
    def trusted(self, wid: str) -> bool: ...
    def only_model(self) -> str: ...
    def lost_at(self, model: str, tokens: Sequence[int], wid: str, held: int) -> float: ...
    def block_size(self, model: str) -> int: ...
    def match_tiers(
        self, model: str, tokens: Sequence[int], hints: Mapping[str, float] | None = None
    ) -> dict[str, tuple[int, int]]: ...


class KvScorer:
    """The index beside the tree: `correct` applies the rules of the module's docstring."""

    def __init__(
        self,
        feed: BlockHolders,
        inflight: float,
        host_weight: Callable[[str], float] = _any_weight,
    ) -> None:
        self.feed = feed
        self.inflight = inflight
        self.host_weight = host_weight  # worker id -> a host-held token's worth (0..1)
        self.corrected = 0  # requests where the index changed the prediction
        # The last request's index part: worker -> (device, host, why) in the tree's
        # units (router/holdings/room.py reads it).
        self.detail: dict[str, tuple[int, int, str]] = {}

    def correct(
        self,
        path: Path,
        tokens: Sequence[int],
        model: str,
        text_len: int,
        now: float,
        overflowed_at: Callable[[object], float] | None = None,
        monotone: bool = False,
    ) -> Path:
        """The tree's `path` with the index merged in (module docstring); `monotone`: the
        tree's times never went back (`in_flight_window`)."""
        feed = self.feed
        self.detail = {}
        count = len(tokens)  # (a Python call for a chat's PromptIds: asked once)
        if not feed.streams or not count:
            return path
        model = model or feed.only_model()
        trusted = feed.trusted
        cutoff = now - self.inflight
        scale = text_len / count
        if monotone and scale == 1 and path:
            deepest, end = path[-1]
            if len(deepest) == 1 == len(path[0][0]):
                # One holder all along the path (a conversation on its worker), in the
                # window: `in_flight_window`'s answer is its deepest entry, and where the
                # index names it alone, all on its device, the rules reduce to a few steps
                # (`_one_holder`); anything else goes on to the rules in full.
                ((w, used),) = deepest.items()
                if used >= cutoff:
                    best = {w: end}
                    # (each worker's search started at its tree end: `hints`, below)
                    tiers = feed.match_tiers(model, tokens, best)
                    if not tiers:
                        return path
                    self.corrected += 1
                    fresh = {w: end} if trusted(w) else {}
                    if fresh and len(tiers) == 1:
                        held = tiers.get(w)
                        if held is not None and held[0] == held[1]:
                            one = self._one_holder(w, end, held[1], text_len, now, cutoff,
                                                   feed, model, overflowed_at)  # fmt: skip
                            if one is not None:
                                return one
                    return self._merged(path, tokens, model, text_len, now, overflowed_at,
                                        cutoff, scale, best, {}, fresh, tiers)  # fmt: skip
        best, past, fresh, changed = in_flight_window(path, trusted, cutoff, monotone)
        # (on the device, in any tier), each worker's search started at its tree end: a
        # conversation's next turn holds about what its last one was routed with
        hints = best if scale == 1 else {w: e / scale for w, e in best.items()}
        tiers = feed.match_tiers(model, tokens, hints)
        if not (changed or tiers):
            return path
        self.corrected += 1
        return self._merged(
            path, tokens, model, text_len, now, overflowed_at, cutoff, scale, best, past,
            fresh, tiers,
        )  # fmt: skip

    def _one_holder(
        self, w: str, end: int, n: int, text_len: int, now: float, cutoff: float,
        feed: BlockHolders, model: str, overflowed_at: Callable[[object], float] | None,
    ) -> Path | None:  # fmt: skip
        """`_merged` where one trusted worker `w` is both the tree's only holder (its
        entry ending at `end`, in the window) and the index's (`n` tokens, all on its
        device), on the tree on ids: None where its in-flight entry may be lost since
        routed (`lost_since_routed` decides). No older entry: nothing to confirm."""
        if n < end:  # (n >= end: at least the entry's whole blocks, not lost)
            block = feed.block_size(model)
            if block and n < int(end) // block * block:
                return None
        chars = on_device = n if n < text_len else text_len
        if overflowed_at is not None and overflowed_at(w) >= cutoff:
            chars = evicting(chars, end if end > 0 else 0)
        self.detail[w] = (on_device, 0, "both" if end else "index")
        return [({w: now}, int(chars if chars > end else end))]

    def _merged(
        self, path: Path, tokens: Sequence[int], model: str, text_len: int, now: float,
        overflowed_at: Callable[[object], float] | None, cutoff: float, scale: float,
        best: dict[object, float], past: Mapping[object, int], fresh: Mapping[object, int],
        tiers: Mapping[str, tuple[int, int]],
    ) -> Path:  # fmt: skip
        """The rules of the module's docstring over the window's answer (`best`, `past`,
        `fresh`) and the index's `tiers`."""
        feed = self.feed
        detail = self.detail
        trusted = feed.trusted
        block = feed.block_size(model)
        if fresh:
            for w in lost_since_routed(path, fresh, tiers, scale, block, feed, model, tokens):
                del best[w]
        weight = self.host_weight
        exact = scale == 1  # (the tree on ids: the index's tokens are its units)
        for w, (device, n) in tiers.items():
            if n == device:  # all of it on the device (no host tier: every lookup)
                on_host = 1.0
                chars = on_device = min(text_len, n if exact else round(n * scale))
                host = 0
            else:
                on_host = host_weighted(n, device, weight, w)
                chars = min(text_len, round((device + on_host * (n - device)) * scale))
                on_device = min(text_len, round(device * scale))
                host = min(text_len, round(n * scale)) - on_device
            end = past.get(w, 0)
            if end:  # (no older entry: nothing to confirm)
                chars = confirmed_exact_end(chars, end, n, device, on_host, scale, block)
            if overflowed_at is not None and overflowed_at(w) >= cutoff and trusted(w):
                chars = evicting(chars, max(end, fresh.get(w, 0)))
            tree = best.get(w, 0)
            if chars > tree:
                best[w] = chars
            detail[w] = (on_device, host, "both" if tree or end else "index")
        if len(best) == 1:  # one holder (a conversation on its worker): no sort, no pass
            for w, e in best.items():
                return [({w: now}, int(e))]
        ends = sorted(set(best.values()))
        return [({w: now for w, e in best.items() if e >= end}, int(end)) for end in ends]


def in_flight_window(
    path: Path, trusted: Callable[[str], bool], cutoff: float, monotone: bool = False
) -> tuple[dict[object, float], dict[object, int], dict[object, int], bool]:
    """A trusted worker's tree entry counts only if used since `cutoff` (the last
    `kv_events_inflight` seconds): older ones the index says the fate of (evicted,
    flushed). The window is the tree's in-flight prediction: a follow-up that arrives
    while the first turn still prefills finds nothing in the index yet (events alone
    lost 13 points of hit rate at overload in the simulator, issue 26;
    test_merge.py::test_a_route_counts_while_in_flight_then_the_index_decides).

    Returns (best: every counted entry's deepest end, past: trusted workers' older
    entries, fresh: trusted workers' entries in the window, whether any was dropped).

    `monotone`: the path is the tree's and its times never went back (tree.py's
    `monotone`): a holder's time on an entry is then never after its time on the ones
    before, so its deepest entry alone says whether all of its are in the window."""
    if monotone and path:
        first, (deepest, end) = path[0][0], path[-1]
        if len(deepest) == len(first):
            # Every entry has the same holders (an entry's holders are a subset of the
            # one before, tree.py's `match_path`): the deepest entry's times are each
            # holder's oldest, one entry read instead of one a turn (a conversation on
            # one worker).
            best: dict[object, float] = {}
            for w in first:  # (the root side's order, as the loops below make it)
                if deepest[w] < cutoff:  # type: ignore[index]
                    break
                best[w] = end
            else:
                fresh: dict[object, int] = {}
                for w in best:
                    if trusted(w):  # type: ignore[arg-type]
                        fresh[w] = end
                return best, {}, fresh, False
        window = _by_holder(path, trusted, cutoff)
        if window is not None:
            return window
        # (two holders with entries before the cutoff: the rule's loop below)
    else:
        # Every entry in the window (the common path: a conversation's turns arrive within
        # it): the deepest entry of each worker, no past one, and trust asked only of the
        # workers found (one comparison and one store a holder, not six steps).
        best = {}
        for holders, end in path:  # root side first: deeper ends overwrite
            for w, used in holders.items():
                if used < cutoff:
                    break
                best[w] = end
            else:
                continue
            break
        else:
            fresh = {}  # (a loop, not a comprehension: no frame a request)
            for w, end in best.items():
                if trusted(w):  # type: ignore[arg-type]
                    fresh[w] = end
            return best, {}, fresh, False
    best = {}  # (an entry before the cutoff: the whole path again, by the rule)
    past: dict[object, int] = {}
    fresh = {}
    changed = False
    trust: dict[object, bool] = {}  # asked once per worker, not once per path entry
    for holders, end in path:  # root side first: deeper ends overwrite
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


def _by_holder(
    path: Path, trusted: Callable[[str], bool], cutoff: float
) -> tuple[dict[object, float], dict[object, int], dict[object, int], bool] | None:
    """`in_flight_window` of a monotone path, holder by holder: each holder of the root
    side's entry (every holder's first) read at its deepest entry, found by a search
    (holders shrink with depth), and where that is before the cutoff, at its deepest
    entry in the window (times fall with depth): a few entries a holder, not every entry
    of a path whose holders differ (4 workers: the root side's entry a prefix every chat
    shares, held by all, the rest by a chat's worker). None where a second holder has an
    entry before the cutoff: `past` is in the order the rule's loop meets them, entry by
    entry."""
    last = len(path) - 1
    deepest = path[last][0]
    best: dict[object, float] = {}
    past: dict[object, int] = {}
    fresh: dict[object, int] = {}
    for w, used in path[0][0].items():  # (the root side's order: the loop's for best, fresh)
        if w in deepest:
            d = last
        else:  # its deepest entry: from the root side out (most hold a shared prefix)
            lo, hi, step = 0, last - 1, 1
            while lo < hi:
                mid = lo + step
                if mid > hi:
                    break
                if w in path[mid][0]:
                    lo = mid
                    step <<= 1
                else:
                    hi = mid - 1
                    break
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if w in path[mid][0]:
                    lo = mid
                else:
                    hi = mid - 1
            d = lo
        holders, end = path[d]
        if not trusted(w):  # type: ignore[arg-type]
            best[w] = end
            continue
        if not holders[w] < cutoff:  # (as the loop tests it: a NaN cutoff counts)
            best[w] = fresh[w] = end
            continue
        if past:
            return None
        past[w] = end
        if used < cutoff:
            continue  # (its root side's entry is its newest: all of them past)
        lo, hi = 0, d - 1  # its deepest entry in the window: entry 0 is, entry d is not
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if path[mid][0][w] < cutoff:
                hi = mid - 1
            else:
                lo = mid
        best[w] = fresh[w] = path[lo][1]
    return best, past, fresh, bool(past)


def lost_since_routed(
    path: Path, fresh: Mapping[object, int], tiers: Mapping[str, tuple[int, int]],
    scale: float, block: int, feed: BlockHolders, model: str, tokens: Sequence[int],
) -> list[object]:  # fmt: skip
    """The in-flight entries that are past, not present: the index has seen the worker
    lose the first block the entry claims beyond what it holds *after* the entry's route
    (its blocks arrived and were evicted since). Otherwise a group replicated on two
    workers kept going to the one that had evicted it, a full miss each time (3 of 9
    extra full misses in a logged shared_prefix run, loadtests/results/kv_events.md;
    test_merge.py::test_an_eviction_reported_after_the_route_outvotes_the_in_flight_entry)."""
    gone = []
    for w, end in fresh.items():
        held = tiers.get(w)  # type: ignore[call-overload]
        n = held[1] if held is not None else 0  # (its tokens in any tier)
        whole = int(end / scale) // block * block if block else 0
        if n >= whole:
            continue
        # The route that claimed the first block the index does not hold: the last
        # one through the tree node holding that block's first token. The path's ends
        # increase (root side first, tree.py's `match_path`): bisected to the first entry
        # past it, not scanned from the root (a 30-turn chat's path has ~16 entries, and
        # this runs on most token requests: the new turn's blocks are not held yet).
        # Asked first: the block is seldom known lost at all (-inf is after no route).
        lost = feed.lost_at(model, tokens, w, n)  # type: ignore[arg-type]
        if lost == _NEVER:
            continue
        i = bisect_right(path, n * scale, key=_end)
        for h, _ in islice(path, i, None):
            if w in h:
                if lost > h[w]:
                    gone.append(w)
                break
    return gone


def host_weighted(n: int, device: int, weight: Callable[[str], float], w: str) -> float:
    """A host-held token is loaded, not computed: cheaper than a miss, dearer than a
    device hit. The tail of the held run from `device` on counts at `weight(w)` (0..1)::

        1 - (kv_bytes_per_token / host_load_bytes_per_s) / prefill_us_per_token

    from the worker's heartbeat (the sim's defaults: 128 KiB over 25 GB/s = 5.2 µs
    against 100 µs of prefill: 0.95), `HOST_HIT_WEIGHT` where it reports no load
    figures, or `kv_events_host_weight` for every worker. Without it a host-held prefix
    ranked as a device-held one (test_merge_tiers.py::
    test_scores_a_host_tail_between_a_device_hit_and_a_miss). Priced here once:
    cost_aware prices these workers' hits at their full prefill (test_merge_tiers.py::
    test_cost_aware_prices_a_host_tier_the_index_weighed_once)."""
    return 1.0 if n == device else weight(w)


def confirmed_exact_end(
    chars: int, end: int, n: int, device: int, on_host: float, scale: float, block: int
) -> int:
    """The index counts whole blocks, the tree exact lengths: where the index holds
    every whole block of a trusted worker's older entry (`end`), the entry is confirmed
    and keeps its exact end. Otherwise a holder seen only through the index ranked up to
    a block short of one routed to in the window for the same prefix (1,040 vs 1,042
    tokens at 16-token blocks) and lost whatever its load (loadtests/results/kv_events.md,
    "Why cost_aware fell below the tree"; test_merge.py::
    test_a_holder_the_index_confirms_ranks_as_the_tree_ranks_it)."""
    whole = int(end / scale) // block * block if block else 0
    if whole and n >= whole:
        start = min(end, device * scale)
        return max(chars, round(start + on_host * (end - start)))
    return chars


def evicting(chars: int, tree_end: int) -> int:
    """A worker the tree's routes overflowed in the window (an insert pushed it over its
    cap) is about to evict its least recently used blocks, i.e. what the index holds but
    no recent route touched: its index match counts only as far as its tree entry. In
    the live capacities case 7 follow-ups went to a 7,500-token worker within 0.1 s, 3
    as index hits, all 7 missed (loadtests/results/kv_events.md, "Why capacities lost";
    test_merge.py::test_routes_that_overflow_a_small_pool_outvote_the_index)."""
    return min(chars, tree_end)
