"""KV events in the simulator: each worker's radix-cache events into the router's real index.

Events: the engine's hook (worker/engine/kv_blocks.py) queues BlockStored / BlockRemoved /
AllBlocksCleared as its radix cache changes. After each engine step the simulator drains
them into one stream entry per worker, stamped with the worker's epoch and a sequence
number as worker/kv_publisher.py stamps them, which the router reads `delay` virtual
seconds after the step *ends* (the KV exists from then on). Entries go through
`KvEventFeed.apply_stream_entry`: the router's own epoch, sequence and trust rules (a
restarted worker is `stale` until its new epoch's AllBlocksCleared arrives, and is routed
on its tree meanwhile), its `BlockIndex` and its `KvScorer`, unchanged.

Not modelled: the msgpack wire form and its validation (the sim's token ids exceed
vLLM's 31-bit range; the wire is tested live), Redis, lag and gaps (`delay` stands for
the publisher's interval plus the reader's poll).

The ceiling: `CacheReader` answers the scorer's questions from every worker's actual
radix cache and its requests in flight at decision time (zero delay, exact to the
token, device tier): the most any router can know about what is, or is about to be, cached.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from router.holdings.kv_feed import FeedMember, KvEventFeed
from shared.wire.kv_events import EventBatch, StreamEntry

if TYPE_CHECKING:
    from worker.engine.kv_blocks import BlockEvents
    from worker.engine.radix_cache import RadixCache

MODEL = "sim"
_TB = 8  # bytes per token id in a radix cache key (int64)


class EventStreams:
    """Every worker's stream, delivered to `feed` in virtual time."""

    def __init__(self, feed: KvEventFeed, delay: float, block_size: int = 16) -> None:
        if delay < 0:
            raise ValueError(f"event delay must be >= 0, got {delay}")
        self.feed = feed
        self.delay = delay
        self.block_size = block_size  # what every worker's heartbeat names
        self.epochs: dict[str, float] = {}
        self._next_seq: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}  # when each stream's last entry is read
        self._due: list[tuple[float, int, str, StreamEntry]] = []
        self._made = 0  # entries made (a tie-break: equal times deliver in creation order)
        self.delivered = 0
        # The index stamps what it learns (a worker's lost blocks) in the policies' clock:
        # here virtual time, when the router reads the entry.
        self.read_at = 0.0
        feed.route_clock = lambda: self.read_at

    def join(self, wid: str, epoch: float) -> None:
        """A worker (re)started: its new epoch, its sequence from 0."""
        self.epochs[wid] = epoch
        self._next_seq[wid] = 0

    def members(self) -> list[FeedMember]:
        """What the router's fleet table hands the feed (`follow`), from the heartbeats."""
        bs = self.block_size
        return [FeedMember(w, MODEL, e, block_size=bs) for w, e in self.epochs.items()]

    def collect(self, wid: str, events: BlockEvents | None, at: float) -> None:
        """Drain `wid`'s pending events into one entry the router reads at `at` + delay."""
        if events is None:
            return
        batch = events.drain(1 << 62)
        if not batch:
            return
        seq = self._next_seq[wid]
        self._next_seq[wid] = seq + 1
        entry = StreamEntry(wid, self.epochs[wid], seq, EventBatch(at, tuple(batch)))
        # A stream is read in order: an entry is never seen before the one written ahead
        # of it (a flush mid-step is drained after the step's stores, seen with them).
        seen = self._last_seen[wid] = max(at + self.delay, self._last_seen.get(wid, 0.0))
        self._made += 1
        heapq.heappush(self._due, (seen, self._made, wid, entry))

    def deliver(self, now: float) -> None:
        """Apply every entry due by `now` (before the router routes at `now`)."""
        due, feed = self._due, self.feed
        while due and due[0][0] <= now:
            self.read_at, _, wid, entry = heapq.heappop(due)
            if wid in feed.streams:
                feed.apply_stream_entry(wid, entry)
                self.delivered += 1


def cached_prefix(cache: RadixCache, tokens: np.ndarray) -> int:
    """Leading tokens of `tokens` on `cache`'s device tier, read without touching it
    (no LRU tick, no split: `match_prefix` does both)."""
    page = cache.page_size
    arr = np.asarray(tokens, dtype=np.int64)
    tb = arr.tobytes()
    kbytes = page * _TB
    end_b = (len(arr) - len(arr) % page) * _TB
    node, pos_b = cache.root, 0
    while pos_b < end_b:
        child = node.children.get(tb[pos_b : pos_b + kbytes])
        if child is None or child.value is None:  # absent, or on the host tier only
            break
        kb = child.kb
        if tb.startswith(kb, pos_b, end_b):
            node, pos_b = child, pos_b + len(kb)
            continue
        pos = pos_b // _TB
        n = min(len(kb) // _TB, len(arr) - pos)
        neq = np.frombuffer(kb[: n * _TB], dtype=np.int64) != arr[pos : pos + n]
        m = int(neq.argmax()) if neq.any() else n
        pos_b += (m - m % page) * _TB
        break
    return pos_b // _TB


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = a[:n] != b[:n]
    return int(neq.argmax()) if neq.any() else n


class CacheReader:
    """What `KvScorer` reads of a feed (router/holdings/merge.BlockHolders), answered from
    the workers themselves at decision time: a worker's match is the longer of its cached
    prefix and the prefix it shares with a request it has in flight (queued or running:
    its KV is on its way). Every worker trusted, nothing late; used with the scorer's
    in-flight window at 0, so the tree's guess plays no part."""

    def __init__(
        self, workers: Callable[[], Sequence[tuple[str, RadixCache, Sequence[np.ndarray]]]]
    ) -> None:
        self._workers = workers
        self.streams = {MODEL: None}  # non-empty: the scorer consults `match`

    def trusted(self, wid: str) -> bool:
        return True

    def only_model(self) -> str:
        return MODEL

    def match_tiers(self, model: str, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        """`match` per tier: every run counted is on the device (`cached_prefix` stops at
        a host-only node; in-flight KV is computed there)."""
        return {w: (n, n) for w, n in self.match(model, tokens).items()}

    def block_size(self, model: str) -> int:
        return 1  # exact to the token

    def lost_at(self, model: str, tokens: Sequence[int], wid: str, held: int) -> float:
        return float("-inf")  # no window: the scorer never asks (inflight 0)

    def match(self, model: str, tokens: Sequence[int]) -> dict[str, int]:
        arr = np.asarray(tokens, dtype=np.int64)
        out = {}
        for wid, cache, inflight in self._workers():
            n = cached_prefix(cache, arr)
            for prompt in inflight:
                n = max(n, common_prefix(arr, prompt))
            if n:
                out[wid] = n
        return out
