"""What the KV-event feed (router/holdings/kv_feed.py) knows of each worker's stream: its
trust status, where its reader is, what it has applied, and what the fleet says of it.

The statuses, and which of the worker's predictions routing reads in each:

    syncing     no known state yet (just joined, or the stream began mid-epoch): tree
    rebuilding  events were lost (router/holdings/feed_entries.py): tree and index
    stale       the heartbeat names a newer epoch than any entry read: tree
    lagging     the reader is more than `max_lag` behind a busy stream, or past its CPU
                share (router/holdings/feed_reader.py): tree
    block_size  the worker's blocks are not the model index's size: tree
    ok          trusted: index (plus the tree's in-flight entries)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamState:
    """One followed worker's stream: its model, where the reader is, what was applied
    and the trust it has earned (`status`)."""

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
    """A worker as the fleet's heartbeats describe it to the feed (`KvEventFeed.follow`)."""

    worker_id: str
    model: str
    epoch: float
    capacity_tokens: int = 0  # its KV pool (heartbeat); 0: unknown
    block_size: int = 0  # tokens per block its heartbeat names; 0: none named
    host_capacity_tokens: int = 0  # its host KV tier (heartbeat)


def members_of(streams: dict[str, StreamState]) -> dict[str, list[str]]:
    """Followed worker ids by model."""
    by_model: dict[str, list[str]] = {}
    for wid, state in streams.items():
        by_model.setdefault(state.model, []).append(wid)
    return by_model
