"""Workers' KV-event streams (Redis) into the router's block index, with trust per worker.

Every router replica reads every worker's stream itself and keeps one `BlockIndex` per
model (router/holdings/kv_index.py). The fleet (router/fleet/table.py) says which workers
exist and their epochs (`follow`); the streams say what they hold. The feed is the books
and their questions; the rest is in its room's files:

    feed_streams.py   what it knows of each stream: trust status, cursor, CPU credit
    feed_reader.py    reading the streams from Redis, bounded (sizes, time, CPU share)
    feed_entries.py   an entry into the index: epochs, sequence, rebuilding after a loss

A worker's index is *trusted* (used for routing on its own) only while the feed is sure
it has every event since a known state. Otherwise the router says why (`status`, in
/metrics, /workers and on the dashboard) and routes that worker on its tree, or on its
tree and its index together while rebuilding (the statuses: feed_streams.py).

Bounds on membership, against a worker's credential (issue 30):
- A worker's cursor outlives its membership: one that rejoins (DEL and rewrite of its
  hash) or changes its model is read on from where the router was, not from "0". One
  back within DEPARTED_S keeps its state and blocks too (a heartbeat that lapsed).
- Each worker holds a bounded share of its model's index (`share`): its pool and host
  tier's blocks (heartbeat) twice over, at most max_blocks / workers of the model; past
  it, its oldest stored blocks are forgotten (router/holdings/kv_index.py).
- A model's block size comes from the router's config (`kv_events_block_size`) or from
  the heartbeats of its workers (the size most of them name; a tie keeps the index's
  size), never from whoever publishes first; a worker whose heartbeat names none is not
  read until it does, and one whose heartbeat or events disagree is `block_size`.
- A model's index is freed when no followed worker serves it, a departed worker's
  blocks when it has been gone DEPARTED_S, both in steps (`drops`, run between reads).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from router.holdings.feed_entries import RUN_BLOCKS, entry_steps, raw_entry_steps
from router.holdings.feed_reader import APPLY_BUDGET_S, CPU_BURST_S, CPU_SHARE, FeedReader
from router.holdings.feed_streams import FeedMember, Rebuild, StreamState, members_of
from router.holdings.kv_index import BlockIndex, Dropping, Freeing
from shared.wire.kv_events import StreamEntry
from shared.wire.registry import Registry

MAX_CURSORS = 4096  # departed workers' cursors kept (registry MAX_WORKERS)
DEPARTED_S = 30.0  # a departed worker's state and blocks kept for its return
SHARE_SLACK = 2  # a worker's share: its reported pool and host tier, in blocks, twice
_NO_DROPS: frozenset[str] = frozenset()


class KvEventFeed:
    """The block indexes and every followed worker's stream state; reads through its
    `reader` (router/holdings/feed_reader.py)."""

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
        self.registry = registry
        self.max_blocks = max_blocks
        self.config_block_size = block_size  # 0: from the heartbeats
        self._cursors: OrderedDict[str, bytes | str] = OrderedDict()  # departed workers'
        # Workers gone from the fleet lately: (state, when, in route_clock time).
        self._departed: OrderedDict[str, tuple[StreamState, float]] = OrderedDict()
        self._block_sizes: dict[str, int] = {}  # worker id -> its heartbeat's block size
        self._host_capacity: dict[str, int] = {}  # worker id -> its host tier in tokens
        self.drops: deque[Dropping | Freeing] = deque()  # blocks being dropped, in steps
        self.route_clock = route_clock  # the policies' `now`: when the index learnt a loss
        self.indexes: dict[str, BlockIndex] = {}  # model -> blocks
        self.streams: dict[str, StreamState] = {}  # worker id -> what was read
        self.dropped: Counter[str] = Counter()
        self.rebuilds: Counter[str] = Counter()  # by cause: "marker" (writer), "gap" (seen here)
        self.capacity: dict[str, int] = {}  # worker id -> its pool in tokens (0: unknown)
        self.reader = FeedReader(
            self, registry, read_count, max_lag, clock, stream_len, apply_budget, cpu_share,
            cpu_burst,
        )  # fmt: skip

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
                    self.forget(m.worker_id)
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
                self.untrust(m.worker_id, "stale")  # the worker restarted: entries to come
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
            self.drop_blocks(state.model, wid)
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
            self.drop_blocks(state.model, wid)
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
                        self.rebuild(wid, "block_size")
                index = None
            if index is None and size:
                index = self.indexes[model] = BlockIndex(size, self.max_blocks)
            for wid in wids:
                state = self.streams[wid]
                named = self._block_sizes.get(wid, 0) or self.config_block_size
                if named and named != size:
                    if state.status != "block_size":
                        self.untrust(wid, "block_size")
                elif state.status == "block_size" and named:
                    self.rebuild(wid, "block_size")  # agrees again: rebuild from here
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
            self.drops = deque(d for d in self.drops if d.index is not index)
            self.drops.append(index.freeing(RUN_BLOCKS))

    def forget(self, wid: str) -> None:
        state = self.streams.get(wid)
        if state is not None:
            self.drop_blocks(state.model, wid)

    def drop_blocks(self, model: str, wid: str) -> None:
        """Its blocks go from the books now, from the index's holders in steps (the run
        loop's, or before the worker's next events apply: `settle_drops`)."""
        index = self.indexes.get(model)
        if index is not None:
            self.drops.append(index.dropping(wid, RUN_BLOCKS))

    def settle_drops(self) -> Iterator[None]:
        """The pending drops to their end, a step at a time."""
        drops = self.drops
        while drops:
            yield from drops[0]
            drops.popleft()

    def _dropping(self, index: BlockIndex) -> set[str]:
        """Workers whose holder entries in `index` are still being dropped."""
        return {d.worker for d in self.drops if d.index is index} if self.drops else set()

    def untrust(self, wid: str, status: str) -> None:
        self.forget(wid)
        self.streams[wid].status = status

    # ---- entries ----------------------------------------------------------------
    def apply_entry(self, wid: str, fields: dict[bytes, bytes]) -> None:
        """One raw entry of `wid`'s stream: its epoch is checked before its batch is
        decoded, so an old epoch's entries are dropped for the price of their fields."""
        for _ in self.raw_steps(wid, fields):
            pass

    def raw_steps(self, wid: str, fields: dict[bytes, bytes]) -> Iterator[None]:
        """`apply_entry` in steps (router/holdings/feed_entries.py): the reader lets the
        event loop run between them."""
        return raw_entry_steps(self, wid, fields)

    def apply_stream_entry(self, wid: str, entry: StreamEntry) -> None:
        """An entry already parsed (and validated) as `wid`'s: epochs, sequence and trust,
        then the index. The simulator (loadtests/simulate/divergence.py) delivers its workers'
        events here, so it routes on the same status and fallback rules as the router."""
        for _ in entry_steps(self, wid, entry):
            pass

    def rebuild(self, wid: str, cause: str) -> None:
        """Events were lost: empty the worker's index and rebuild it from what follows
        (router/holdings/feed_entries.py)."""
        self.forget(wid)
        state = self.streams[wid]
        state.status, state.removed = "rebuilding", 0
        self.rebuilds[cause] += 1

    # ---- reading (router/holdings/feed_reader.py) -------------------------------
    async def poll(self, block_ms: int | None = None) -> int:
        """`FeedReader.poll`: read every readable stream once (see there)."""
        return await self.reader.poll(block_ms)

    async def run(self, members: Callable[[], Iterable[FeedMember]], idle: float) -> None:
        """`FeedReader.run`: follow the fleet, read and trim until `stop` (or cancelled)."""
        await self.reader.run(members, idle)

    def stop(self) -> None:
        """`run` ends at its next turn: set before cancelling it (FeedReader.run says why)."""
        self.reader.stop()

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
        usable = ("ok", "rebuilding")  # rebuilding: beside its tree (feed_entries.py)
        streams, dropping = self.streams, self._dropping(index)
        return {
            w: n
            for w, n in index.match(tokens).items()
            if (s := streams.get(w)) is not None and s.status in usable and w not in dropping
        }

    def match_tiers(
        self, model: str, tokens: Sequence[int] | np.ndarray,
        hints: Mapping[str, float] | None = None,
    ) -> dict[str, tuple[int, int]]:  # fmt: skip
        """`match` per tier: (tokens of `tokens` on its device, tokens in any tier) for
        each trusted or rebuilding worker. `hints`: where each worker's search starts
        (router/holdings/kv_index.py `match_tiers`). A route's question: the reader's next
        read starts now if one is due (router/holdings/feed_reader.py `asked`)."""
        self.reader.asked()
        index = self.indexes.get(model)
        if index is None:
            return {}
        found = index.match_tiers(tokens, hints)
        if not found:
            return found  # (a fresh dict: no holder of the first block)
        usable = ("ok", "rebuilding")  # as in `match`
        streams, dropping = self.streams, self._dropping(index) if self.drops else _NO_DROPS
        for w in found:  # (a loop, not a comprehension: no frame where every one is usable)
            s = streams.get(w)
            if s is None or s.status not in usable or w in dropping:
                break
        else:
            return found  # (a fresh dict: the index's own)
        return {
            w: n
            for w, n in found.items()
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
        indexes = self.indexes
        if len(indexes) == 1:
            for model in indexes:  # (no iterator object and `next` call a request)
                return model
        return ""

    def status_counts(self) -> Counter[str]:
        return Counter(s.status for s in self.streams.values())
