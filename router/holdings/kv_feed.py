"""Workers' KV-event streams (Redis) into the router's block index, with trust per worker.

Every router replica reads every worker's stream itself (XREAD, no consumer group) and
keeps one `BlockIndex` per model (router/holdings/kv_index.py). The fleet (router/fleet/table.py) says
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
(`match` returns rebuilding workers, `trusted` does not: router/holdings/merge.py keeps
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

Bounds against a worker's credential (issue 30: one worker's stream stalled every router):
- Sizes are checked in Redis before a read (shared/wire/registry.py `read_kv_events`): an
  entry over MAX_ENTRY_BYTES never crosses the wire, and the reader trims the stream past
  it (measured once, its memory back to Redis). Routers trim every followed stream to
  `stream_len` entries (a worker's own MAXLEN is not trusted).
- Entries are applied with a time budget: past `apply_budget` seconds of the event loop
  the feed yields, so `/health` and routing run between its steps. A step is at most one
  event's decode (a batch over SLICED_BYTES is decoded an event at a time; msgpack holds
  the GIL, so a thread would not free the loop) or one run of RUN_BLOCKS blocks applied
  to the index. An entry's epoch is checked before its batch is decoded: an old epoch's
  entries cost a few field reads each.
- A worker's cursor outlives its membership: one that rejoins (DEL and rewrite of its
  hash) or changes its model is read on from where the router was, not from "0". One
  back within DEPARTED_S keeps its state and blocks too (a heartbeat that lapsed).
- Each worker's stream takes at most CPU_SHARE of the event loop (a credit refilled over
  time, CPU_BURST_S at once); past it its entries wait in Redis and it is `lagging`.
- Each worker holds a bounded share of its model's index (`share`): its pool and host
  tier's blocks (heartbeat) twice over, at most max_blocks / workers of the model; past
  it, its oldest stored blocks are forgotten (router/holdings/kv_index.py).
- A model's block size comes from the router's config (`kv_events_block_size`) or from
  the heartbeats of its workers (the size most of them name; a tie keeps the index's
  size), never from whoever publishes first; a worker whose heartbeat names none is not
  read until it does, and one whose heartbeat or events disagree is `block_size`.
- A model's index is freed when no followed worker serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from redis.exceptions import RedisError

from router.holdings.kv_index import BlockIndex, Dropping, Freeing
from router.holdings.namespace import in_default_namespace
from shared.serving.aio import reraise_if_cancelled
from shared.wire.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BatchReader,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    StreamEntry,
    parse_header,
)
from shared.wire.registry import Registry

log = logging.getLogger(__name__)

STATUSES = ("ok", "syncing", "rebuilding", "stale", "lagging", "block_size")
APPLY_BUDGET_S = 0.005  # event-loop time spent applying entries before yielding once
POLL_S = 0.05  # between reads of idle streams (a sized read cannot block in Redis)
READ_GAP_S = 0.2  # after a read that reached the end of every stream (`run`)
# A batch larger than this is decoded an event at a time (shared/wire/kv_events.py
# BatchReader), the loop free between; smaller ones in one call (~1 ms).
SLICED_BYTES = 64 * 1024
# Events are applied to the index in runs of up to this many blocks (~1-2 us each), one
# call a run; the feed may yield between runs. An honest entry is one run.
RUN_BLOCKS = 2048
TRIM_EVERY_S = 1.0  # between the router's trims of the followed streams (cheap: MAXLEN ~)
MAX_CURSORS = 4096  # departed workers' cursors kept (registry MAX_WORKERS)
DEPARTED_S = 30.0  # a departed worker's state and blocks kept for its return
SHARE_SLACK = 2  # a worker's share: its reported pool and host tier, in blocks, twice
# Event-loop time one worker's stream may take: 0.1 s a second, 0.5 s at once. Honest
# workers need far less (kv_events.md: ~0.3 ms per routed request's events); past it the
# stream waits (unread, nothing lost) and the worker is `lagging` (routed on its tree).
CPU_SHARE = 0.1
CPU_BURST_S = 0.5


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
    credit: float = 0.0  # seconds of event-loop time it may still spend (CPU_SHARE)
    credited_at: float | None = None  # perf_counter time of the last refill


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
    block_size: int = 0  # tokens per block its heartbeat names; 0: none named
    host_capacity_tokens: int = 0  # its host KV tier (heartbeat)


class KvEventFeed:
    def __init__(
        self,
        registry: Registry,
        max_blocks: int = 2_000_000,
        read_count: int = 256,
        max_lag: float = 2.0,
        clock: Callable[[], float] = time.time,
        route_clock: Callable[[], float] = time.monotonic,
        block_size: int = 0,
        stream_len: int = 10_000,
        apply_budget: float = APPLY_BUDGET_S,
        cpu_share: float = CPU_SHARE,
        cpu_burst: float = CPU_BURST_S,
    ) -> None:
        self.cpu_share, self.cpu_burst = cpu_share, cpu_burst
        self.throttled = 0  # reads a worker's stream waited for its CPU share
        self.registry = registry
        self.max_blocks = max_blocks
        self.config_block_size = block_size  # 0: from the heartbeats
        self.stream_len = stream_len
        self.apply_budget = apply_budget
        self._cursors: OrderedDict[str, bytes | str] = OrderedDict()  # departed workers'
        # Workers gone from the fleet lately: (state, when, in route_clock time).
        self._departed: OrderedDict[str, tuple[StreamState, float]] = OrderedDict()
        self._block_sizes: dict[str, int] = {}  # worker id -> its heartbeat's block size
        self._host_capacity: dict[str, int] = {}  # worker id -> its host tier in tokens
        self._trimmed = 0.0
        self._slice_at = 0.0  # perf_counter time the feed last let the loop run
        self._drops: deque[Dropping | Freeing] = deque()  # blocks being dropped, in steps
        self._oversized: dict[str, bytes] = {}  # worker -> its last oversized entry read
        self._turn = 0  # rotates the read order (`readable`)
        self._drained = False  # the last read reached the end of every stream it read
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
            self._block_sizes[m.worker_id] = m.block_size
            self._host_capacity[m.worker_id] = m.host_capacity_tokens
            state = self.streams.get(m.worker_id)
            if state is None:  # a join, or a rejoin (its hash was gone for a while)
                state = self._rejoin(m.worker_id, m.model)
            if state is None or state.model != m.model:
                fresh = StreamState(m.model, m.epoch)
                if state is not None:
                    self._forget(m.worker_id)
                    fresh.cursor = state.cursor  # a model change: read on, not from "0"
                    # and on the CPU share it has left (a fresh burst each flip gave a
                    # worker changing its model every second half the event loop)
                    fresh.credit, fresh.credited_at = state.credit, state.credited_at
                else:
                    fresh.cursor = self._cursors.pop(m.worker_id, "0")  # a rejoin: read on
                self.streams[m.worker_id] = fresh
                continue
            if m.epoch != state.heartbeat_epoch:
                state.heartbeat_epoch = m.epoch
            if m.epoch > state.epoch and state.status in ("ok", "rebuilding"):
                self._untrust(m.worker_id, "stale")  # the worker restarted: entries to come
        now = self.route_clock()
        for wid in [w for w in self.streams if w not in seen]:
            # Kept a while, its blocks too: a heartbeat that lapsed for a poll (a stalled
            # worker, a DEL and rewrite) comes back as it was, nothing read again.
            self._departed[wid] = (self.streams.pop(wid), now)
            self._departed.move_to_end(wid)
            self.capacity.pop(wid, None)
            self._block_sizes.pop(wid, None)
            self._host_capacity.pop(wid, None)
        while self._departed:
            wid, (state, left) = next(iter(self._departed.items()))
            if now - left < DEPARTED_S and len(self._departed) <= MAX_CURSORS:
                break
            del self._departed[wid]
            self._drop_blocks(state.model, wid)
            self._cursors[wid] = state.cursor  # only where to read on from
            self._cursors.move_to_end(wid)
            if len(self._cursors) > MAX_CURSORS:
                self._cursors.popitem(last=False)
        self._settle_indexes(members_of(self.streams))

    def _rejoin(self, wid: str, model: str) -> StreamState | None:
        """A departed worker's state, back in `streams` (None: none kept). Another model:
        its blocks go, its cursor stays."""
        gone = self._departed.pop(wid, None)
        if gone is None:
            return None
        state = gone[0]
        if state.model != model:
            self._drop_blocks(state.model, wid)
        self.streams[wid] = state
        return state

    def _settle_indexes(self, by_model: dict[str, list[str]]) -> None:
        """Each model's block size (config, else most heartbeats), its workers' shares,
        and no index for a model no followed worker serves."""
        for model in [m for m in self.indexes if m not in by_model]:
            self.drop_model(model)
        for model, wids in by_model.items():
            size = self._model_block_size(model, wids)
            index = self.indexes.get(model)
            if index is not None and index.block_size != size:
                self.drop_model(model)  # most workers name another size now: rebuild
                for wid in wids:
                    if self.streams[wid].status in ("ok", "lagging", "rebuilding"):
                        self._rebuild(wid, "block_size")
                index = None
            if index is None and size:
                index = self.indexes[model] = BlockIndex(size, self.max_blocks)
            for wid in wids:
                state = self.streams[wid]
                named = self._block_sizes.get(wid, 0) or self.config_block_size
                if named and named != size:
                    if state.status != "block_size":
                        self._untrust(wid, "block_size")
                elif state.status == "block_size" and named:
                    self._rebuild(wid, "block_size")  # agrees again: rebuild from here
            if index is not None:
                index.shares = {w: self._share(w, index.block_size, len(wids)) for w in wids}

    def _model_block_size(self, model: str, wids: list[str]) -> int:
        if self.config_block_size:
            return self.config_block_size
        votes = Counter(b for w in wids if (b := self._block_sizes.get(w, 0)))
        if not votes:
            return 0
        index = self.indexes.get(model)
        top = max(votes.values())
        if index is not None and votes.get(index.block_size) == top:
            return index.block_size  # a tie keeps the index's size
        return min(b for b, n in votes.items() if n == top)

    def _share(self, wid: str, block_size: int, workers: int) -> int:
        """The most blocks `wid` may hold in its model's index (see the module doc)."""
        fair = max(1, self.max_blocks // max(1, workers))
        tokens = self.capacity.get(wid, 0) + self._host_capacity.get(wid, 0)
        if not tokens:
            return fair
        return min(fair, SHARE_SLACK * -(-tokens // block_size))

    def drop_model(self, model: str) -> None:
        """Free `model`'s index (no followed worker serves it), in steps as a drop is."""
        index = self.indexes.pop(model, None)
        if index is not None:
            self._drops = deque(d for d in self._drops if d.index is not index)
            self._drops.append(index.freeing(RUN_BLOCKS))

    def _forget(self, wid: str) -> None:
        state = self.streams.get(wid)
        if state is not None:
            self._drop_blocks(state.model, wid)

    def _drop_blocks(self, model: str, wid: str) -> None:
        """Its blocks go from the books now, from the index's holders in steps (the run
        loop's, or before the worker's next events apply: `_settle_drops`)."""
        index = self.indexes.get(model)
        if index is not None:
            self._drops.append(index.dropping(wid, RUN_BLOCKS))

    def _settle_drops(self) -> Iterator[None]:
        """The pending drops to their end, a step at a time."""
        drops = self._drops
        while drops:
            yield from drops[0]
            drops.popleft()

    def _dropping(self, index: BlockIndex) -> set[str]:
        """Workers whose holder entries in `index` are still being dropped."""
        return {d.worker for d in self._drops if d.index is index} if self._drops else set()

    def _untrust(self, wid: str, status: str) -> None:
        self._forget(wid)
        self.streams[wid].status = status

    # ---- reading ----------------------------------------------------------------
    async def poll(self, block_ms: int | None = None) -> int:
        """Read every readable stream once; with `block_ms`, again every POLL_S until
        something is read or `block_ms` has passed. Returns the entries read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (block_ms or 0) / 1000
        while True:
            failures = self.failures
            read = await self._poll_once()
            if read or self.failures != failures or loop.time() + POLL_S > deadline:
                return read
            await asyncio.sleep(POLL_S)

    def readable(self) -> dict[str, bytes | str]:
        """The cursors of the streams to read: those whose model has a block size and
        whose worker agrees with it. Each read starts one stream further along: a reply
        is bounded in bytes, so one busy stream must not always come first."""
        indexes = self.indexes
        now = time.perf_counter()
        items = [
            (w, s.cursor)
            for w, s in self.streams.items()
            if s.status != "block_size" and s.model in indexes and self._has_credit(s, now)
        ]
        self._turn += 1
        k = self._turn % len(items) if items else 0
        return dict(items[k:] + items[:k])

    def _has_credit(self, state: StreamState, now: float) -> bool:
        """Refill the stream's CPU credit; out of it, it waits (and is not trusted)."""
        if state.credited_at is None:
            state.credit = self.cpu_burst
        else:
            state.credit += (now - state.credited_at) * self.cpu_share
            state.credit = min(state.credit, self.cpu_burst)
        state.credited_at = now
        if state.credit > 0:
            return True
        self.throttled += 1
        if state.status == "ok":
            state.status = "lagging"  # behind its stream by choice: trust waits
        return False

    async def _poll_once(self) -> int:
        self._slice_at = time.perf_counter()
        if self._drops:  # (follow's: a departed or restarted worker, an unused model)
            await self._run_steps(self._settle_drops(), None)
        cursors = self.readable()
        if not cursors:
            return 0
        try:
            replies = await self.registry.read_kv_events(cursors, self.read_count)
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelled()
            self.failures += 1
            log.debug("KV event streams unreadable: %s", exc)
            return 0
        read = 0
        self._slice_at = time.perf_counter()
        self._drained = all(len(entries) < self.read_count for _, entries in replies)
        for wid, entries in replies:
            for entry_id, fields in entries:
                state = self.streams.get(wid)
                if state is None:  # (not while this task applies: follow runs between)
                    break
                if state.credit <= 0:
                    break  # its CPU share is spent: the rest waits in its stream
                state.cursor = entry_id
                read += 1
                if b"oversized" in fields:  # its read stopped there: more may follow
                    self._oversized[wid] = entry_id
                    self._drained = False
                await self._run_steps(self._raw_steps(wid, fields), state)
            state = self.streams.get(wid)
            if state is not None:
                self._check_lag(state, entries)
        await self._trim_oversized()
        return read

    async def _trim_oversized(self) -> None:
        """Trim each stream past the oversized entry just read (registry.py says why)."""
        while self._oversized:
            wid, entry_id = self._oversized.popitem()
            try:
                await self.registry.trim_kv_events_past(wid, entry_id)
            except (RedisError, OSError, TimeoutError) as exc:
                reraise_if_cancelled()
                log.debug("KV event stream %s not trimmed: %s", wid, exc)

    async def _run_steps(self, steps: Iterator[None], state: StreamState | None) -> None:
        """Run `steps`, letting the event loop run whenever `apply_budget` has passed since
        it last did (and after the last step); `state`'s stream pays for its steps."""
        clock = time.perf_counter
        began = clock()
        for _ in steps:
            now = clock()
            if now - self._slice_at > self.apply_budget:
                if state is not None:
                    state.credit -= now - began  # the stream pays its own steps only
                await asyncio.sleep(0)  # let requests and /health run between
                began = self._slice_at = clock()
        now = clock()
        if state is not None:
            state.credit -= now - began
        if now - self._slice_at > self.apply_budget:
            await asyncio.sleep(0)
            self._slice_at = clock()

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
        """One raw entry of `wid`'s stream: its epoch is checked before its batch is
        decoded, so an old epoch's entries are dropped for the price of their fields."""
        for _ in self._raw_steps(wid, fields):
            pass

    def _raw_steps(self, wid: str, fields: dict[bytes, bytes]) -> Iterator[None]:
        if b"oversized" in fields:  # measured in Redis and left there (registry.py)
            self.dropped["oversized"] += 1
            return
        try:
            header = parse_header(wid, fields)
            if self._stale(self.streams[wid], header.epoch):
                self.dropped["stale_epoch"] += 1
                return
            if len(header.payload) <= SLICED_BYTES:
                entry = header.decode()
            else:  # up to 4 MB: an event a step; the entry is applied whole or not at all
                reader = BatchReader(header.payload)
                events = []
                for event in reader.events():
                    events.append(event)
                    yield
                batch = EventBatch(reader.ts, tuple(events))
                entry = StreamEntry(wid, header.epoch, header.seq, batch, header.resync)
        except ValueError as exc:
            reason = "other_worker" if "another worker" in str(exc) else "malformed"
            if "too large" in str(exc):
                reason = "oversized"
            self.dropped[reason] += 1
            return
        if wid not in self.streams:
            return  # gone while it was decoded
        yield from self._entry_steps(wid, entry)

    @staticmethod
    def _stale(state: StreamState, epoch: float) -> bool:
        return epoch < max(state.epoch, 0.0) or epoch < state.heartbeat_epoch - 1e-6

    def apply_stream_entry(self, wid: str, entry: StreamEntry) -> None:
        """An entry already parsed (and validated) as `wid`'s: epochs, sequence and trust,
        then the index. The simulator (loadtests/simulate/divergence.py) delivers its workers'
        events here, so it routes on the same status and fallback rules as the router."""
        for _ in self._entry_steps(wid, entry):
            pass

    def _entry_steps(self, wid: str, entry: StreamEntry) -> Iterator[None]:
        """`apply_stream_entry` in runs of up to RUN_BLOCKS blocks (`_event_runs`): the reader
        may yield to the event loop between runs. An honest entry is one run, one index
        call."""
        state = self.streams[wid]
        if self._stale(state, entry.epoch):
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
        if self._drops:  # none of its old blocks may outlive its new ones
            yield from self._settle_drops()
        index = self.indexes.get(state.model, _EMPTY)
        for run in _event_runs(events, self.dropped):
            if self.streams.get(wid) is not state:
                return  # it left (or rejoined afresh) while the loop ran
            if isinstance(run[0], AllBlocksCleared):
                self._drop_blocks(state.model, wid)
                yield from self._settle_drops()
                continue
            try:
                index.apply(wid, run, self.route_clock())
            except ValueError:  # a block size other than the model's
                self.dropped["block_size"] += 1
                self._untrust(wid, "block_size")
                return
            if state.status == "rebuilding":
                self._count_removals(wid, state, run)
            yield
        state.applied += 1

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

    async def run(self, members: Callable[[], Iterable[FeedMember]], idle: float) -> None:
        """Follow the fleet, read and trim forever (cancel to stop).

        How often it reads (each read is a Redis round trip, ~90 µs of the router's CPU
        whatever it brings): a read that leaves entries behind (a full page) is followed
        at once; one that reads every stream to its end waits READ_GAP_S, so it takes a
        few of a busy writer's batches at a time (workers write every 50 ms); an empty
        one waits twice as long as the last wait, up to `idle`. Reading every 50 ms made
        this task most of what KV events cost a router behind one busy worker (~20 reads
        a second, most of them empty; loadtests/results/router_cpu.md). The index then
        lags the streams by up to READ_GAP_S while they are busy, `idle` after a quiet
        spell: a route's own blocks are the tree's to predict meanwhile (merge.py's
        `in_flight_window`, 2 s)."""
        loop = asyncio.get_running_loop()
        wait = POLL_S
        while True:
            self.follow(members())
            failures = self.failures
            if not self.streams:
                await asyncio.sleep(idle)
                continue
            read = await self.poll()
            if loop.time() - self._trimmed > TRIM_EVERY_S:
                self._trimmed = loop.time()
                await self._trim()
            if self.failures != failures:
                await asyncio.sleep(idle)
            elif not read:
                wait = min(idle, wait * 2)
                await asyncio.sleep(wait)
            elif self._drained:
                wait = READ_GAP_S
                await asyncio.sleep(wait)

    async def _trim(self) -> None:
        try:
            await self.registry.trim_kv_events(list(self.streams), self.stream_len)
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelled()
            log.debug("KV event streams not trimmed: %s", exc)

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
        streams, dropping = self.streams, self._dropping(index)
        return {
            w: n
            for w, n in index.match(tokens).items()
            if (s := streams.get(w)) is not None and s.status in usable and w not in dropping
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
        streams, dropping = self.streams, self._dropping(index)
        return {
            w: n
            for w, n in index.match_tiers(tokens).items()
            if (s := streams.get(w)) is not None and s.status in usable and w not in dropping
        }

    def lost_at(self, model: str, tokens: Sequence[int] | np.ndarray, wid: str, held: int) -> float:
        """When `wid` stopped holding the block after its first `held` tokens of `tokens`
        (router/holdings/kv_index.py), in `route_clock` time; -inf: not known lost."""
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


def members_of(streams: dict[str, StreamState]) -> dict[str, list[str]]:
    """Followed worker ids by model."""
    by_model: dict[str, list[str]] = {}
    for wid, state in streams.items():
        by_model.setdefault(state.model, []).append(wid)
    return by_model


def _event_runs(events: Sequence[KVEvent], dropped: Counter[str]) -> Iterator[list[KVEvent]]:
    """`events` in runs of up to RUN_BLOCKS blocks, each AllBlocksCleared a run of its own
    (the feed drops the worker's blocks in steps), an event in another namespace left out
    (counted), an event of more blocks split into pieces (`_pieces`)."""
    run: list[KVEvent] = []
    blocks = 0
    for event in events:
        if isinstance(event, AllBlocksCleared):
            if run:
                yield run
                run, blocks = [], 0
            yield [event]
            continue
        if not in_default_namespace(event):
            dropped["namespace"] += 1  # the index holds a model's default namespace
            continue
        n = len(event.block_hashes)  # type: ignore[union-attr]
        if blocks + n <= RUN_BLOCKS:  # the common case: the event joins the run
            run.append(event)
            blocks += n
            continue
        for piece in _pieces(event) if n > RUN_BLOCKS else (event,):
            n = len(piece.block_hashes)  # type: ignore[union-attr]
            if run and blocks + n > RUN_BLOCKS:
                yield run
                run, blocks = [], 0
            run.append(piece)
            blocks += n
    if run:
        yield run


def _pieces(event: KVEvent) -> Iterator[KVEvent]:
    """`event` in pieces of up to RUN_BLOCKS blocks, applied as the whole would be: each
    stored piece under the last block of the one before."""
    hashes: tuple = event.block_hashes  # type: ignore[union-attr]
    n = RUN_BLOCKS
    for i in range(0, len(hashes), n):
        if isinstance(event, BlockRemoved):
            yield BlockRemoved(hashes[i : i + n], event.medium)
        elif isinstance(event, BlockStored):
            bs, keys = event.block_size, event.extra_keys
            yield BlockStored(
                hashes[i : i + n],
                event.parent_block_hash if i == 0 or bs == 0 else hashes[i - 1],
                event.token_ids[i * bs : (i + n) * bs],
                bs, event.medium, None if keys is None else keys[i : i + n], event.lora,
            )  # fmt: skip


def _last_clear(events: Sequence[KVEvent]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], AllBlocksCleared):
            return i
    return None
