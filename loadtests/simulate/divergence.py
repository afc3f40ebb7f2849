"""Divergence cases in virtual time: where a router's picture of the caches goes wrong.

The fleet simulation (loadtests/simulate/simulation.py) with one case and one arm. Cases (a
`Case` is frozen; `CASES` names the standard ones), on closed-loop conversations that
share one system prompt (the `multi_turn` workload):

    baseline    nothing diverges: every request goes through the router
    direct      a second client sends each conversation's first turn straight to a
                seeded random worker (the router never sees it); the rest go through it
    flush       halfway through (by routed requests), `flush` of the workers (a seeded
                choice) flush their caches; 1.0: all of them
    restart     halfway through, `restart` of the workers restart: a new engine (empty
                cache, new epoch); what they were running is sent again to the new one.
                Their heartbeat's new epoch makes every arm's policy forget their tree
                (`remove_worker`), as the router's fleet table does
    capacities  `small` of the workers have KV pools `small_ratio` times smaller; the tree
                caps each worker at its capacity x chars per token, as the router does

Users think a seeded random while before each turn (`think_s`), so turns do not arrive
in waves. Arms: `tree` (the prefix tree on the text, caps at `tree_chars_per_token`: the router
without a tokenizer), `tree_tokens` (the tree on the prompt ids: `tokenizer` set, no
events), `events` (tree on ids + the index fed by the workers' events after
`event_delay`; loadtests/simulate/divergence.py) and `ceiling` (tree on ids + every worker's
actual cache read at decision time). Hit rate and TTFT count the requests the router
routed (not the second client's), as the live bench (loadtests/router/bench_kv_events.py) does.

KV events in the simulator (`EventStreams`, `CacheReader` below): each worker's radix-cache events into the router's real index.

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

import dataclasses
import heapq
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loadtests.load.workloads import Session
from loadtests.simulate.simulation import (
    _ARRIVAL,
    SimRequest,
    Simulation,
    WordTokenizer,
    reply_text,
)
from loadtests.simulate.worker import CostModel, Job, SimWorker
from router.holdings.kv_feed import FeedMember, KvEventFeed
from router.holdings.merge import KvScorer
from router.policy.base import FleetView, RouteRequest
from shared.config import RouterConfig
from shared.wire.kv_events import EventBatch, StreamEntry
from worker.engine.radix_cache import RadixCache

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

    def match_tiers(
        self, model: str, tokens: Sequence[int], hints: Mapping[str, float] | None = None
    ) -> dict[str, tuple[int, int]]:
        """`match` per tier: every run counted is on the device (`cached_prefix` stops at
        a host-only node; in-flight KV is computed there). No search to start: `hints`
        unused."""
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


ARMS = ("tree", "tree_tokens", "events", "ceiling")


@dataclass(frozen=True)
class Case:
    name: str
    direct: bool = False
    flush: float = 0.0  # fraction of workers flushed halfway
    restart: float = 0.0  # fraction of workers restarted halfway
    small: float = 0.0  # fraction of workers with small KV pools
    small_ratio: float = 8.0


CASES = {
    c.name: c
    for c in (
        Case("baseline"),
        Case("direct", direct=True),
        Case("flush", flush=1.0),
        Case("flush_half", flush=0.5),
        Case("restart", restart=0.25),
        Case("capacities", small=0.5),
    )
}


@dataclass(frozen=True)
class ArmSpec:
    arm: str
    event_delay: float = 0.05  # virtual seconds from a step's end to the router's index
    block_size: int = 16  # tokens per event block


class DivergenceSim(Simulation):
    def __init__(
        self,
        config: RouterConfig,
        workers: int,
        cost: CostModel,
        case: Case,
        spec: ArmSpec,
        halfway: int,
        seed: int = 0,
        think_s: float = 0.0,
        reply_hits: bool = False,
    ) -> None:
        if spec.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {spec.arm!r}")
        if spec.arm != "tree":  # the tree keys on the prompt ids
            config = config.model_copy(update={"tokenizer": "sim"})
        if spec.arm == "events":
            cost = dataclasses.replace(cost, kv_events_block_size=spec.block_size)
        super().__init__(config, workers, cost, seed)
        self.case, self.spec = case, spec
        self._rng = random.Random(f"{seed}:divergence")  # the case's own choices
        order = self._rng.sample(range(workers), workers)
        small = set(order[: round(case.small * workers)])
        costs = [
            dataclasses.replace(cost, cache_tokens=int(cost.cache_tokens / case.small_ratio))
            if i in small
            else cost
            for i in range(workers)
        ]
        self.workers = [SimWorker(i, c) for i, c in enumerate(costs)]
        caps = tuple(c.cache_tokens + c.host_cache_tokens for c in costs)
        self.views = FleetView(self.ids, capacities=caps)
        # Users think a random while before each turn (exponential, this mean; drawn per
        # conversation and turn, so every arm sees the same): without it closed-loop users
        # send their turns in waves, and a whole wave lands inside an event delay.
        self.think_s, self._seed = think_s, seed
        # The engine caches a reply's own ids; the next turn carries the reply as text. By
        # default the sim's reply ids never equal that text's ids (no reply is a hit);
        # `reply_hits` makes them equal, as a chat template that round-trips does.
        self.reply_hits = reply_hits
        self.halfway = halfway  # routed requests before the flush / restart
        self.routed = 0
        self.direct: set[int] = set()  # rids the second client sent
        self.reachable = 0  # ceiling: tokens the best holder had at each decision
        self.streams: EventStreams | None = None
        self.feed: KvEventFeed | None = None
        self._heartbeats: list[str] = []  # restarted workers the router hears of next
        self.kv: KvScorer | None = None
        if spec.arm == "events":
            self.feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # fed, not polled
            self.streams = EventStreams(self.feed, spec.event_delay, spec.block_size)
            for wid in self.ids:
                self.streams.join(wid, 1.0)
            self.feed.follow(self.streams.members())
            self.kv = KvScorer(self.feed, config.kv_events_inflight)
        elif spec.arm == "ceiling":  # exact in flight too: no window on the tree's guess
            self.kv = KvScorer(self._reader(), 0.0)
        self.policy.holdings.kv = self.kv

    def _reader(self) -> CacheReader:
        def workers() -> list[tuple[str, RadixCache, list[np.ndarray]]]:
            return [
                (w, s.cache, [j.tokens for j in s._by_rid.values()])
                for w, s in zip(self.ids, self.workers, strict=True)
            ]

        return CacheReader(workers)

    # ---- the engine's events out ----------------------------------------------------
    def _start_step(self, i: int, now: float) -> None:
        super()._start_step(i, now)
        if self.streams is not None:
            worker = self.workers[i]
            end = now + worker.runner.last_step_s if worker.busy else now
            self.streams.collect(self.ids[i], worker.engine.kv_events, end)

    # ---- routing ------------------------------------------------------------------
    def _route(self, job: Job, now: float) -> None:
        if self.streams is not None:
            self.streams.deliver(now)
        if self._heartbeats:
            self._hear_restarts()
        if job.rid in self.direct:
            self._submit(self._rng.randrange(len(self.workers)), job, now)
            return
        self.routed += 1
        if self.routed == self.halfway + 1:
            self._diverge(now)
        for i in self._unread:
            self.views.reported_at[i] = now
        self._unread.clear()
        tokens = job.tokens
        if self.spec.arm == "ceiling":
            held = self.kv.feed.match(MODEL, tokens)  # type: ignore[union-attr]
            self.reachable += max(held.values(), default=0)
        request = RouteRequest(job.text, tokens=tokens, model=MODEL)
        t0 = time.thread_time_ns()
        decision = self.policy.select(request, self.views, now)
        self._decision_ns.append(time.thread_time_ns() - t0)
        self.reasons[decision.reason] += 1
        self._submit(self.index[decision.worker_id], job, now)

    def _submit(self, i: int, job: Job, now: float) -> None:
        worker = self.workers[i]
        if not worker.fits(job):
            self.rejected += 1
            return
        worker.submit(job)
        if not worker.busy:
            self._start_step(i, now)
        self._refresh(i, now)

    def _next_turn(self, sessions: list[Session], s: int, now: float, tok: WordTokenizer) -> None:
        req = sessions[s].next_request()
        if req is None:
            return
        text = req.text()
        job = self._job(SimRequest(now, text, tok.encode(text), req.max_tokens), session=s)
        if self.reply_hits:  # the ids the reply will have inside the next turn's prompt
            reply = reply_text(job.rid, len(job.out_tokens))
            job.out_tokens = tok.encode("<|assistant|>" + reply)
        turn = sum(1 for r, _ in req.messages if r == "user")
        if self.think_s:
            think = random.Random(f"{self._seed}:{req.session_id}:{turn}").expovariate(1.0)
            job.arrival = now = now + think * self.think_s
        if self.case.direct and turn == 1:
            self.direct.add(job.rid)
        self._push(now, _ARRIVAL, job)

    # ---- the divergence -----------------------------------------------------------
    def _diverge(self, now: float) -> None:
        n = len(self.workers)
        order = self._rng.sample(range(n), n)
        for i in order[: round(self.case.flush * n)]:
            self.workers[i].engine.flush_cache()
            if self.streams is not None:
                self.streams.collect(self.ids[i], self.workers[i].engine.kv_events, now)
        for i in order[: round(self.case.restart * n)]:
            self._restart(i, now)

    def _restart(self, i: int, now: float) -> None:
        old = self.workers[i]
        new = self.workers[i] = SimWorker(i, old.cost)
        for job in list(old._by_rid.values()):  # a retrying client: from scratch
            job.admitted, job.cached = -1.0, 0
            new.submit(job)
        # The old worker's step end is still on the heap: it will start the new one's.
        new.busy = old.busy
        if not new.busy:
            self._start_step(i, now)
        self._refresh(i, now)
        if self.streams is not None:
            self.streams.join(self.ids[i], self.streams.epochs[self.ids[i]] + 1.0)
        self._heartbeats.append(self.ids[i])

    def _hear_restarts(self) -> None:
        """The heartbeats name new epochs: the router forgets those trees (fleet table)."""
        for wid in self._heartbeats:
            self.policy.holdings.forget(wid)
        self._heartbeats.clear()
        if self.feed is not None and self.streams is not None:
            self.feed.follow(self.streams.members())

    # ---- results ------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        jobs = [j for j in self._done if j.rid not in self.direct]
        prompt = sum(len(j.tokens) for j in jobs)
        ttft = np.array([j.ttft for j in jobs]) * 1e3
        out: dict[str, object] = {
            "requests": len(jobs),
            "hit_rate": sum(j.cached for j in jobs) / prompt if prompt else 0.0,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "reasons": dict(self.reasons),
            "rejected": self.rejected,
        }
        if self.spec.arm == "ceiling":
            out["best_holder_rate"] = self.reachable / prompt if prompt else 0.0
        if self.feed is not None:
            out["feed_status"] = dict(self.feed.status_counts())
            out["feed_dropped"] = dict(self.feed.dropped)
            out["corrected"] = self.kv.corrected if self.kv else 0
        return out
