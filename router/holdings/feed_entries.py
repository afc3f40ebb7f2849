"""One worker's stream entries into its model's block index: epochs, sequence and trust
(the statuses: router/holdings/feed_streams.py), for the KV-event feed
(router/holdings/kv_feed.py).

Resync: an AllBlocksCleared (an empty cache, or our engine's periodic republish of its
whole tree) is a known state; the feed applies events from it on. A new epoch clears the
worker's index and waits for one.

Rebuilding, after lost events (a sequence jump, the writer's `resync` marker after a gap
a stock engine's replay could not serve, or the start of an epoch whose first batches
were never read). A stock vLLM never republishes its cache, so waiting for an
AllBlocksCleared could mean waiting forever. Instead the worker's index is emptied (what
it held may since have been removed, unseen) and rebuilt from the events after the loss:
it then holds only blocks the worker really holds (stored after the loss and not removed
since), an under-estimate, so the worker's tree entries count beside it (`match` returns
rebuilding workers, `trusted` does not: router/holdings/merge.py keeps their tree
matches). It is trusted alone again once the worker's pool has turned over: blocks
removed from its GPU pool since the loss >= the pool's block count (the capacity its
heartbeat reports / block size; unknown capacity: rebuilding until a clear).

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
out of the feed or reaches the index. An entry's epoch is checked before its batch is
decoded: an old epoch's entries cost a few field reads each. Applying is in steps (the
generators below yield between them, and the reader, router/holdings/feed_reader.py,
lets the event loop run there): a step is at most one event's decode (a batch over
SLICED_BYTES is decoded an event at a time; msgpack holds the GIL, so a thread would not
free the loop) or one run of RUN_BLOCKS blocks and RUN_TOKENS tokens applied to the index.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from router.holdings.feed_streams import Rebuild, StreamState
from router.holdings.kv_index import BlockIndex, Dropping, Freeing
from router.holdings.namespace import in_default_namespace
from shared.wire.kv_events import (
    ID_CHARS,
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

# A batch larger than this is decoded an event at a time (shared/wire/kv_decode.py
# BatchReader), the loop free between; smaller ones in one call (~1 ms).
SLICED_BYTES = 64 * 1024
# Events are applied to the index in runs of up to this many blocks (~1-2 us each) and
# tokens, one call a run; the feed may yield between runs. An honest entry is one run.
# The token bound is RUN_BLOCKS blocks of vLLM's default 16 tokens: without it one event
# of 4M token ids in large blocks (a heartbeat may name any block size up to 4,096) was
# one run, ~70-220 ms of the event loop in one index call (measured here, 2 busy cores).
RUN_BLOCKS = 2048
RUN_TOKENS = RUN_BLOCKS * 16


class FeedBooks(Protocol):
    """What applying entries reads and changes of the feed (router/holdings/kv_feed.py's
    KvEventFeed): its streams, indexes and counts, and its trust changes."""

    streams: dict[str, StreamState]
    indexes: Mapping[str, BlockIndex]
    dropped: Counter[str]
    drops: deque[Dropping | Freeing]
    route_clock: Callable[[], float]

    def forget(self, wid: str) -> None: ...
    def rebuild(self, wid: str, cause: str) -> None: ...
    def untrust(self, wid: str, status: str) -> None: ...
    def drop_blocks(self, model: str, wid: str) -> None: ...
    def settle_drops(self) -> Iterator[None]: ...
    def rebuild_of(self, wid: str) -> Rebuild | None: ...


def raw_entry_steps(feed: FeedBooks, wid: str, fields: dict[bytes, bytes]) -> Iterator[None]:
    """One raw entry of `wid`'s stream, parsed, decoded and applied in steps."""
    if b"oversized" in fields:  # measured in Redis and left there (registry.py)
        feed.dropped["oversized"] += 1
        return
    try:
        header = parse_header(wid, fields)
        if is_stale(feed.streams[wid], header.epoch):
            feed.dropped["stale_epoch"] += 1
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
        feed.dropped[reason] += 1
        return
    if wid not in feed.streams:
        return  # gone while it was decoded
    yield from entry_steps(feed, wid, entry)


def is_stale(state: StreamState, epoch: float) -> bool:
    """An entry of an epoch older than the one applied, or than the heartbeat names."""
    return epoch < max(state.epoch, 0.0) or epoch < state.heartbeat_epoch - 1e-6


def entry_steps(feed: FeedBooks, wid: str, entry: StreamEntry) -> Iterator[None]:
    """An entry parsed (and validated) as `wid`'s: epochs, sequence and trust, then the
    index in runs of up to RUN_BLOCKS blocks (`event_runs`): the reader may yield to the
    event loop between runs. An honest entry is one run, one index call."""
    state = feed.streams[wid]
    if is_stale(state, entry.epoch):
        feed.dropped["stale_epoch"] += 1
        return
    events: Sequence[KVEvent] = entry.batch.events
    if entry.epoch > state.epoch:  # a new epoch: its cache started empty
        feed.forget(wid)
        state.epoch, state.next_seq = entry.epoch, None
        if state.status != "block_size":
            state.status = "syncing"
    if state.next_seq is not None and entry.seq != state.next_seq:
        if entry.seq < state.next_seq:
            feed.dropped["out_of_sequence"] += 1
            return
        feed.dropped["gap"] += 1
        if state.status in ("ok", "lagging", "rebuilding") and not entry.resync:
            feed.rebuild(wid, "gap")
    state.next_seq = entry.seq + 1
    if entry.resync and state.status != "block_size":
        feed.rebuild(wid, "marker")
    if state.status not in ("ok", "lagging", "rebuilding"):
        clear = last_clear(events)
        if clear is None or state.status == "block_size":
            return  # nothing known to build on yet
        events = events[clear:]
        state.status = "ok"
    elif state.status == "rebuilding" and (clear := last_clear(events)) is not None:
        events = events[clear:]  # a known state after all (vLLM cleared its cache)
        state.status = "ok"
    if feed.drops:  # none of its old blocks may outlive its new ones
        yield from feed.settle_drops()
    index = feed.indexes.get(state.model, _EMPTY)
    for run in event_runs(events, feed.dropped):
        if feed.streams.get(wid) is not state:
            return  # it left (or rejoined afresh) while the loop ran
        if type(run[0]) is AllBlocksCleared:
            feed.drop_blocks(state.model, wid)
            yield from feed.settle_drops()
            continue
        try:
            index.apply(wid, run, feed.route_clock())
        except ValueError:  # a block size other than the model's
            feed.dropped["block_size"] += 1
            feed.untrust(wid, "block_size")
            return
        if state.status == "rebuilding":
            count_removals(feed, wid, state, run)
        yield
    state.applied += 1


def count_removals(
    feed: FeedBooks, wid: str, state: StreamState, events: Sequence[KVEvent]
) -> None:
    """A rebuilding worker's GPU removals; trusted again once its pool has turned over
    (the module doc). A host tier's removals say nothing about the GPU pool's turnover."""
    state.removed += sum(
        len(e.block_hashes)
        for e in events
        if isinstance(e, BlockRemoved) and e.medium in (None, MEDIUM_GPU)
    )
    needed = feed.rebuild_of(wid).needed  # type: ignore[union-attr]
    if needed and state.removed >= needed:
        state.status = "ok"


class _NoIndex(BlockIndex):
    """Events with no stored block for a model not indexed yet: nothing to hold."""

    def apply(self, worker: str, events: Sequence[KVEvent], now: float = 0.0) -> None:
        return None


_EMPTY = _NoIndex(1, 1)


def event_runs(events: Sequence[KVEvent], dropped: Counter[str]) -> Iterator[list[KVEvent]]:
    """`events` in runs of up to RUN_BLOCKS blocks and RUN_TOKENS tokens, each
    AllBlocksCleared a run of its own (the feed drops the worker's blocks in steps), an
    event in another namespace left out (counted), a larger event split into pieces
    (`block_pieces`)."""
    run: list[KVEvent] = []
    blocks = tokens = 0
    for event in events:
        kind = type(event)  # (by exact type: kv_index.py `apply` says why)
        if kind is BlockStored:
            # (no LoRA and no extra keys: the default namespace without the call)
            if (event.lora is not None or event.extra_keys is not None) and not (
                in_default_namespace(event)
            ):
                dropped["namespace"] += 1  # the index holds a model's default namespace
                continue
            t = len(event.token_ids)
        elif kind is AllBlocksCleared:
            if run:
                yield run
                run, blocks, tokens = [], 0, 0
            yield [event]
            continue
        else:
            t = 0
        n = len(event.block_hashes)
        if blocks + n <= RUN_BLOCKS and tokens + t <= RUN_TOKENS:  # the common case
            run.append(event)
            blocks += n
            tokens += t
            continue
        big = n > RUN_BLOCKS or t > RUN_TOKENS
        for piece in block_pieces(event) if big else (event,):
            n = len(piece.block_hashes)  # type: ignore[union-attr]
            t = len(piece.token_ids) if isinstance(piece, BlockStored) else 0
            if run and (blocks + n > RUN_BLOCKS or tokens + t > RUN_TOKENS):
                yield run
                run, blocks, tokens = [], 0, 0
            run.append(piece)
            blocks += n
            tokens += t
    if run:
        yield run


def block_pieces(event: KVEvent) -> Iterator[KVEvent]:
    """`event` in pieces of up to RUN_BLOCKS blocks and RUN_TOKENS tokens (at least one
    block), applied as the whole would be: each stored piece under the last block of the
    one before."""
    hashes: tuple = event.block_hashes  # type: ignore[union-attr]
    bs = event.block_size if isinstance(event, BlockStored) else 0
    n = min(RUN_BLOCKS, max(1, RUN_TOKENS // bs)) if bs else RUN_BLOCKS
    for i in range(0, len(hashes), n):
        if isinstance(event, BlockRemoved):
            yield BlockRemoved(hashes[i : i + n], event.medium)
        elif isinstance(event, BlockStored):
            keys, text = event.extra_keys, event.token_text
            yield BlockStored(
                hashes[i : i + n],
                event.parent_block_hash if i == 0 or bs == 0 else hashes[i - 1],
                event.token_ids[i * bs : (i + n) * bs],
                bs, event.medium, None if keys is None else keys[i : i + n], event.lora,
                None if text is None else text[i * bs * ID_CHARS : (i + n) * bs * ID_CHARS],
            )  # fmt: skip


def last_clear(events: Sequence[KVEvent]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], AllBlocksCleared):
            return i
    return None
