"""Workers' KV-event streams (Redis) into the router's block index, with trust per worker.

Every router replica reads every worker's stream itself (XREAD, no consumer group) and
keeps one `BlockIndex` per model (router/fleet/kv_index.py). The fleet (router/fleet/table.py) says
which workers exist and their epochs; the streams say what they hold.

A worker's index is *trusted* (used for routing on its own) only while the feed is sure
it has every event since a known state. Otherwise the router says why (`status`, in
/metrics, /workers and on the dashboard) and routes that worker on its tree, or on its
tree and its index together while rebuilding:

    syncing     no known state yet (just joined, or the stream began mid-epoch): tree
    rebuilding  events were lost (a sequence jump, or the writer's `resync` marker after
                a gap a stock engine's replay could not serve, or at the start of an
                epoch whose first batches it never got): tree ∪ index
    stale       the heartbeat names a newer epoch than any entry read: tree
    lagging     the reader is more than `max_lag` behind a busy stream: tree
    block_size  the worker's blocks are not the model index's size: tree
    ok          trusted: index (plus the tree's in-flight entries)

Resync: an AllBlocksCleared (an empty cache, or our engine's periodic republish of its
whole tree) is a known state; the feed applies events from it on. A new epoch clears the
worker's index and waits for one.

Rebuilding, after lost events. A stock vLLM never republishes its cache, so waiting for
an AllBlocksCleared could mean waiting forever. Instead the worker's index is emptied
(what it held may since have been removed, unseen) and rebuilt from the events after
the loss: it then holds only blocks the worker really holds (stored after the loss and
not removed since), an under-estimate, so the worker's tree entries count beside it
(`match` returns rebuilding workers, `trusted` does not: router/policy/kv_score.py keeps
their tree matches). It is trusted alone again once the worker's pool has turned over:
blocks removed from its GPU pool since the loss >= the pool's block count (the capacity
its heartbeat reports / block size; unknown capacity: rebuilding until a clear).

Why that bound: the engine evicts its least recently used free block. A block held at
the loss and not used since is older than every block used since, so it goes before
any of them; there are at most pool-size such blocks, so pool-size removals have
evicted all of them. What it misses: a block held at the loss and *hit* since (vLLM
publishes nothing on a hit) can stay resident forever, e.g. a hot system prompt, and the
rebuilt index never learns it, nor the blocks stored below it since (their parent is
unknown: `orphan`); the worker is then under-predicted for that prefix (routed elsewhere
at worst, never sent a prefix it lacks), and once trusted again the tree covers it only
while its entries are in flight. Blocks pinned by running requests are not evictable
and count as used.

Entries are untrusted input: malformed, oversized, naming another worker, of an older
epoch, or out of sequence, they are dropped and counted (`dropped[reason]`); none raises
out of the feed or reaches the index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from redis.exceptions import RedisError

from router.fleet.kv_index import BlockIndex
from shared.serving.aio import reraise_if_cancelled
from shared.wire.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StreamEntry,
    parse_entry,
)
from shared.wire.registry import Registry

log = logging.getLogger(__name__)

STATUSES = ("ok", "syncing", "rebuilding", "stale", "lagging", "block_size")


@dataclass
class StreamState:
    model: str
    heartbeat_epoch: float
    cursor: bytes | str = "0"  # the last entry id read ("0": from the stream's start)
    epoch: float = -1.0  # of the entries applied
    next_seq: int | None = None  # the sequence number the next entry must carry
    status: str = "syncing"
    applied: int = 0  # entries applied
    removed: int = 0  # GPU blocks the worker removed since it began rebuilding


@dataclass(frozen=True)
class Rebuild:
    """A rebuilding worker's progress: trusted again at removed >= needed."""

    removed: int
    needed: int  # the pool's blocks; 0: unknown (rebuilding until an AllBlocksCleared)


@dataclass(frozen=True)
class FeedMember:
    worker_id: str
    model: str
    epoch: float
    capacity_tokens: int = 0  # its KV pool (heartbeat); 0: unknown


class KvEventFeed:
    def __init__(
        self,
        registry: Registry,
        max_blocks: int = 2_000_000,
        read_count: int = 256,
        max_lag: float = 2.0,
        clock: Callable[[], float] = time.time,
        route_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.max_blocks = max_blocks
        self.read_count = read_count
        self.max_lag = max_lag
        self.clock = clock  # wall time: stream entry ids are milliseconds of it
        self.route_clock = route_clock  # the policies' `now`: when the index learnt a loss
        self.indexes: dict[str, BlockIndex] = {}  # model -> blocks
        self.streams: dict[str, StreamState] = {}  # worker id -> what was read
        self.dropped: Counter[str] = Counter()
        self.rebuilds: Counter[str] = Counter()  # by cause: "marker" (writer), "gap" (seen here)
        self.capacity: dict[str, int] = {}  # worker id -> its pool in tokens (0: unknown)
        self.failures = 0

    # ---- membership (from the fleet) --------------------------------------------
    def follow(self, members: Iterable[FeedMember]) -> None:
        """Start reading joined workers, forget departed ones, notice new epochs."""
        seen = set()
        for m in members:
            seen.add(m.worker_id)
            self.capacity[m.worker_id] = m.capacity_tokens
            state = self.streams.get(m.worker_id)
            if state is None or state.model != m.model:
                if state is not None:
                    self._forget(m.worker_id)
                self.streams[m.worker_id] = StreamState(m.model, m.epoch)
                continue
            if m.epoch != state.heartbeat_epoch:
                state.heartbeat_epoch = m.epoch
            if m.epoch > state.epoch and state.status in ("ok", "rebuilding"):
                self._untrust(m.worker_id, "stale")  # the worker restarted: entries to come
        for wid in [w for w in self.streams if w not in seen]:
            self._forget(wid)
            del self.streams[wid]
            self.capacity.pop(wid, None)

    def _forget(self, wid: str) -> None:
        state = self.streams.get(wid)
        if state is not None and state.model in self.indexes:
            self.indexes[state.model].drop_worker(wid)

    def _untrust(self, wid: str, status: str) -> None:
        self._forget(wid)
        self.streams[wid].status = status

    # ---- reading ----------------------------------------------------------------
    async def poll(self, block_ms: int | None = None) -> int:
        """One XREAD over every followed stream; returns the entries read."""
        cursors = {w: s.cursor for w, s in self.streams.items()}
        try:
            replies = await self.registry.read_kv_events(cursors, self.read_count, block_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelled()
            self.failures += 1
            log.debug("KV event streams unreadable: %s", exc)
            return 0
        read = 0
        for wid, entries in replies:
            state = self.streams.get(wid)
            if state is None:
                continue
            for entry_id, fields in entries:
                state.cursor = entry_id
                self.apply_entry(wid, fields)
                read += 1
            self._check_lag(state, entries)
        return read

    def _check_lag(self, state: StreamState, entries: Sequence[tuple[bytes, object]]) -> None:
        """A full read means more is waiting: behind by more than max_lag is untrusted."""
        if len(entries) < self.read_count:
            if state.status == "lagging":
                state.status = "ok"
            return
        last = entries[-1][0]
        ms = int((last.decode() if isinstance(last, bytes) else last).split("-")[0])
        if self.clock() - ms / 1000 > self.max_lag and state.status == "ok":
            state.status = "lagging"  # still applied: only trust waits

    def apply_entry(self, wid: str, fields: dict[bytes, bytes]) -> None:
        try:
            entry = parse_entry(wid, fields)
        except ValueError as exc:
            reason = "other_worker" if "another worker" in str(exc) else "malformed"
            if "too large" in str(exc):
                reason = "oversized"
            self.dropped[reason] += 1
            return
        self.apply_stream_entry(wid, entry)

    def apply_stream_entry(self, wid: str, entry: StreamEntry) -> None:
        """An entry already parsed (and validated) as `wid`'s: epochs, sequence and trust,
        then the index. The simulator (loadtests/simulate/divergence.py) delivers its workers'
        events here, so it routes on the same status and fallback rules as the router."""
        state = self.streams[wid]
        if entry.epoch < max(state.epoch, 0.0) or entry.epoch < state.heartbeat_epoch - 1e-6:
            self.dropped["stale_epoch"] += 1
            return
        events: Sequence[KVEvent] = entry.batch.events
        if entry.epoch > state.epoch:  # a new epoch: its cache started empty
            self._forget(wid)
            state.epoch, state.next_seq = entry.epoch, None
            if state.status != "block_size":
                state.status = "syncing"
        if state.next_seq is not None and entry.seq != state.next_seq:
            if entry.seq < state.next_seq:
                self.dropped["out_of_sequence"] += 1
                return
            self.dropped["gap"] += 1
            if state.status in ("ok", "lagging", "rebuilding") and not entry.resync:
                self._rebuild(wid, "gap")
        state.next_seq = entry.seq + 1
        if entry.resync and state.status != "block_size":
            self._rebuild(wid, "marker")
        clear = _last_clear(events)
        if state.status not in ("ok", "lagging", "rebuilding"):
            if clear is None or state.status == "block_size":
                return  # nothing known to build on yet
            events = events[clear:]
            state.status = "ok"
        elif state.status == "rebuilding" and clear is not None:
            events = events[clear:]  # a known state after all (vLLM cleared its cache)
            state.status = "ok"
        index = self._index(state.model, events)
        try:
            index.apply(wid, events, self.route_clock())
        except ValueError:  # a block size other than the model's
            self.dropped["block_size"] += 1
            self._untrust(wid, "block_size")
            return
        state.applied += 1
        if state.status == "rebuilding":
            self._count_removals(wid, state, events)

    def _rebuild(self, wid: str, cause: str) -> None:
        """Events were lost: empty the worker's index and rebuild it from what follows."""
        self._forget(wid)
        state = self.streams[wid]
        state.status, state.removed = "rebuilding", 0
        self.rebuilds[cause] += 1

    def _count_removals(self, wid: str, state: StreamState, events: Sequence[KVEvent]) -> None:
        # GPU pool only: a host tier's removals say nothing about the GPU pool's turnover.
        state.removed += sum(
            len(e.block_hashes)
            for e in events
            if isinstance(e, BlockRemoved) and e.medium in (None, MEDIUM_GPU)
        )
        needed = self.rebuild_of(wid).needed  # type: ignore[union-attr]
        if needed and state.removed >= needed:
            state.status = "ok"  # the pool has turned over: see the module doc

    def _index(self, model: str, events: Sequence[KVEvent]) -> BlockIndex:
        index = self.indexes.get(model)
        if index is None:
            size = next(
                (e.block_size for e in events if isinstance(e, BlockStored) and e.block_size),
                None,
            )
            if size is None:
                return _EMPTY
            index = self.indexes[model] = BlockIndex(size, self.max_blocks)
        return index

    async def run(self, members: Callable[[], Iterable[FeedMember]], idle: float) -> None:
        """Follow the fleet and read forever (cancel to stop)."""
        while True:
            self.follow(members())
            failures = self.failures
            if self.streams:
                await self.poll(block_ms=int(idle * 1000))  # waits up to `idle` for news
            if not self.streams or self.failures != failures:
                await asyncio.sleep(idle)

    # ---- routing ----------------------------------------------------------------
    def trusted(self, wid: str) -> bool:
        state = self.streams.get(wid)
        return state is not None and state.status == "ok"

    def match(self, model: str, tokens: Sequence[int] | np.ndarray) -> dict[str, int]:
        """Tokens of `tokens` each trusted or rebuilding worker holds (whole blocks from
        the start)."""
        index = self.indexes.get(model)
        if index is None:
            return {}
        usable = ("ok", "rebuilding")  # rebuilding: beside its tree (see the module doc)
        streams = self.streams
        return {
            w: n
            for w, n in index.match(tokens).items()
            if (s := streams.get(w)) is not None and s.status in usable
        }

    def match_tiers(
        self, model: str, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, tuple[int, int]]:
        """`match` per tier: (tokens of `tokens` on its device, tokens in any tier) for
        each trusted or rebuilding worker."""
        index = self.indexes.get(model)
        if index is None:
            return {}
        usable = ("ok", "rebuilding")  # as in `match`
        streams = self.streams
        return {
            w: n
            for w, n in index.match_tiers(tokens).items()
            if (s := streams.get(w)) is not None and s.status in usable
        }

    def lost_at(self, model: str, tokens: Sequence[int] | np.ndarray, wid: str, held: int) -> float:
        """When `wid` stopped holding the block after its first `held` tokens of `tokens`
        (router/fleet/kv_index.py), in `route_clock` time; -inf: not known lost."""
        index = self.indexes.get(model)
        return index.lost_at(wid, tokens, held) if index is not None else float("-inf")

    def block_size(self, model: str) -> int:
        """Tokens per block of `model`'s index (0: none yet)."""
        index = self.indexes.get(model)
        return index.block_size if index is not None else 0

    def status_of(self, wid: str) -> str:
        state = self.streams.get(wid)
        return state.status if state is not None else "syncing"

    def rebuild_of(self, wid: str) -> Rebuild | None:
        """A rebuilding worker's progress (None: not rebuilding)."""
        state = self.streams.get(wid)
        if state is None or state.status != "rebuilding":
            return None
        index = self.indexes.get(state.model)
        size = index.block_size if index is not None else 0
        capacity = self.capacity.get(wid, 0)
        return Rebuild(state.removed, capacity // size if size and capacity else 0)

    def only_model(self) -> str:
        """The model when the fleet serves one (requests that name none)."""
        return next(iter(self.indexes)) if len(self.indexes) == 1 else ""

    def status_counts(self) -> Counter[str]:
        return Counter(s.status for s in self.streams.values())


class _NoIndex(BlockIndex):
    """Events with no stored block for a model not indexed yet: nothing to hold."""

    def apply(self, worker: str, events: Sequence[KVEvent], now: float = 0.0) -> None:
        return None


_EMPTY = _NoIndex(1, 1)


def _last_clear(events: Sequence[KVEvent]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], AllBlocksCleared):
            return i
    return None
