"""Event-driven simulation of a router over workers: the router's real policy over simulated workers.

Virtual time, no sleeping, no HTTP. Per request: the policy from `router.policy`
(`build_policy(RouterConfig)`, with its real prefix tree) picks a worker from the
workers' loads (running + queued, as the router sees in flight); that `SimWorker`
(the engine's own scheduler and radix cache over the sim cost model) runs it, one
engine step at a time. Step ends at the same instant run before arrivals, so freed
capacity is seen first. The CPU time
(thread time) of each `select` call alone is measured: the router's cost per decision,
apart from the simulator's own work (worker caches, event heap), and the
policy's memory is measured once at the end by walking its object graph.

The requests (`mooncake_requests`, `generated_requests`): token ids for the worker, text for the router.

- Mooncake trace: each block id becomes `block_words` token ids of its own (unique per
  block, so equal leading blocks are exactly a shared prefix) and the same block's
  words as text. A fleet of N workers replays `ceil(N / workers_per_copy)` copies of
  the trace, each with its own block-id namespace and a random phase, so load per
  worker and reuse per worker stay the same as the fleet grows.
- Generated workloads (`shared_prefix`, `rag`): the generator's requests with Poisson
  arrivals at `rate` req/s; the text is split into words, one token id per word.
- `multi_turn` is closed loop: `users` simulated users each keep a conversation
  (loadtests.load.workloads.ConversationSession); a turn is sent when the last one ends.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from loadtests.kit import WorkloadOptions
from loadtests.load.workloads import VOCAB, Session, Workload, read_trace
from loadtests.simulate.worker import CostModel, Job, SimWorker
from router.policy import build_policy
from router.policy.base import FleetView, RouteRequest
from shared.config import RouterConfig
from shared.tokens.text_tokenizer import TextTokenizer
from shared.wire.registry import WorkerRecord

_M64 = (1 << 64) - 1
_OUT_BASE = 1 << 56  # output token ids: unique per request, never equal to a prompt id


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    text: str
    tokens: np.ndarray
    out_len: int
    session_key: str = ""  # what the live client sends as x-session-id (LLMRequest.session_id)


class WordTokenizer:
    """One id per whitespace-separated word: deterministic, and a text that extends
    another at a word boundary gets ids that extend the other's ids."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> np.ndarray:
        ids = self._ids
        return np.fromiter((ids.setdefault(w, len(ids)) for w in text.split()), dtype=np.int64)


class LiveTokenizer:
    """The live sim workers' tokenizer (shared/tokens/text_tokenizer.py) as ids: a
    prediction of a live fleet (`pack`) counts prompts, and so fills caches, in the
    tokens the live workers count (about two per generated word, not one)."""

    def __init__(self) -> None:
        self._tok = TextTokenizer()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text), dtype=np.int64)


def output_tokens(rid: int, n: int) -> np.ndarray:
    start = _OUT_BASE + rid * 65_536
    return np.arange(start, start + n, dtype=np.int64)


def _mix(x: int) -> int:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Blocks:
    """Words of a namespaced block id, from a cheap deterministic mix (no RNG object per block)."""

    def __init__(self, seed: int, block_words: int) -> None:
        self.block_words = block_words
        self._seed = seed
        self._offsets = np.arange(block_words, dtype=np.int64)
        self._cache: dict[int, str] = {}

    def text(self, block: int) -> str:
        got = self._cache.get(block)
        if got is None:
            if len(self._cache) > 400_000:  # bounded: copies of the trace never share blocks
                self._cache.clear()
            h = _mix(block ^ (self._seed << 48))
            n = len(VOCAB)
            got = " ".join(VOCAB[_mix(h + j) % n] for j in range(self.block_words))
            got += " "
            self._cache[block] = got
        return got

    def tokens(self, blocks: list[int], n: int) -> np.ndarray:
        arr = np.asarray(blocks, dtype=np.int64)[:, None] * self.block_words + self._offsets
        return arr.ravel()[:n]


def mooncake_requests(
    o: WorkloadOptions, workers: int, workers_per_copy: int, speedup: float, seed: int
) -> Iterator[SimRequest]:
    """The trace, `ceil(workers / workers_per_copy)` times over, merged in arrival order."""
    trace = read_trace(o.trace, o.trace_limit)
    copies = max(1, math.ceil(workers / workers_per_copy))
    span = max(float(r["timestamp"]) for r in trace) / 1000.0 / speedup or 1.0  # type: ignore[arg-type]
    rng = random.Random(seed)
    phases = [0.0] + [rng.uniform(0, span) for _ in range(copies - 1)]
    blocks = _Blocks(o.seed, o.block_words)

    def one_copy(c: int) -> Iterator[tuple[float, int, int]]:
        # (arrival, copy, line): shifted by the copy's phase, wrapped around the trace span.
        times = [(float(r["timestamp"]) / 1000.0 / speedup + phases[c]) % span for r in trace]  # type: ignore[arg-type]
        return iter(sorted((t, c, i) for i, t in enumerate(times)))

    for t, c, i in heapq.merge(*(one_copy(c) for c in range(copies))):
        rec = trace[i]
        ids = [c << 32 | int(b) for b in rec["hash_ids"]]  # type: ignore[union-attr]
        n = max(2, math.ceil(int(rec["input_length"]) * o.block_words / 512))  # type: ignore[call-overload]
        out = max(1, int(rec.get("output_length", o.output_len)))  # type: ignore[call-overload]
        if o.max_output is not None:
            out = min(out, o.max_output)
        text = "".join(blocks.text(b) for b in ids)
        yield SimRequest(t, text, blocks.tokens(ids, n), out)


def generated_requests(o: WorkloadOptions, rate: float, seed: int) -> Iterator[SimRequest]:
    """An open-loop generator's requests, Poisson arrivals at `rate` req/s."""
    tok = WordTokenizer()
    rng = random.Random(seed)
    t = 0.0
    for req in Workload(o).requests():
        t += rng.expovariate(rate)
        text = req.text()
        yield SimRequest(t, text, tok.encode(text), req.max_tokens, req.session_id)


def reply_text(rid: int, n: int) -> str:
    """A simulated assistant reply of `n` words (multi-turn sends it back next turn)."""
    rng = random.Random(rid)
    return " ".join(rng.choices(VOCAB, k=n))


_STEP_END, _ARRIVAL = 0, 1  # event kinds: step ends sort first at equal times


@dataclass(frozen=True)
class ClosedLoop:
    """`users` users each send a request when their previous one finished (+ think time):
    multi-turn users keep a conversation each; for the other workloads they take the
    next request of one shared stream, as the live locust users do."""

    options: WorkloadOptions
    users: int
    think_s: float = 0.0


@dataclass
class SimResult:
    label: str
    workers: int
    ttft: np.ndarray
    queue: np.ndarray
    e2e: np.ndarray
    per_worker_requests: np.ndarray
    decision_us: np.ndarray
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    rejected: int = 0
    makespan: float = 0.0
    policy_bytes: int = 0
    run_cpu_s: float = 0.0  # thread CPU of the whole replay, policy included
    reasons: Counter[str] = field(default_factory=Counter)
    host_cached_tokens: int = 0  # of cached_tokens, loaded from host tiers
    busy: float = 0.0  # virtual time workers spent in steps / (workers x makespan)

    @property
    def requests(self) -> int:
        return len(self.ttft)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_max_over_mean(self) -> float:
        mean = self.per_worker_requests.mean() if len(self.per_worker_requests) else 0
        return float(self.per_worker_requests.max() / mean) if mean else 0.0

    @property
    def sim_us_per_request(self) -> float:
        """The simulator's own CPU per request (workers' caches, events), policy excluded."""
        n = len(self.decision_us)
        return (self.run_cpu_s * 1e6 - float(self.decision_us.sum())) / n if n else 0.0

    def pct(self, values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")

    def row(self) -> dict[str, object]:
        return {
            "label": self.label,
            "workers": self.workers,
            "requests": self.requests,
            "rejected": self.rejected,
            "preemptions": self.preemptions,
            "throughput_rps": self.requests / self.makespan if self.makespan else 0.0,
            "hit_rate": self.hit_rate,
            "ttft_p50_ms": self.pct(self.ttft, 50) * 1e3,
            "ttft_p99_ms": self.pct(self.ttft, 99) * 1e3,
            "queue_p50_ms": self.pct(self.queue, 50) * 1e3,
            "queue_p99_ms": self.pct(self.queue, 99) * 1e3,
            "load_max_over_mean": self.load_max_over_mean,
            "decision_us_mean": float(self.decision_us.mean()) if len(self.decision_us) else 0.0,
            "decision_us_p99": self.pct(self.decision_us, 99),
            "policy_mb": self.policy_bytes / 2**20,
            "sim_us_per_request": self.sim_us_per_request,
            "host_hit_rate": self.host_cached_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "busy": self.busy,
            "reasons": dict(self.reasons),
        }


def deep_size(root: object) -> int:
    """Bytes of every object reachable from `root` (shared ones once); classes,
    modules and functions are not counted: they are code, not routing state."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    skip = (type, type(sys), type(deep_size), type(len))
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


class Simulation:
    def __init__(
        self, config: RouterConfig, workers: int, cost: CostModel, seed: int = 0,
        tokenizer: WordTokenizer | LiveTokenizer | None = None,
    ) -> None:  # fmt: skip
        """`tokenizer`: the closed-loop users' prompts as ids (default: one id per word)."""
        self.tokenizer = tokenizer or WordTokenizer()
        self.policy = build_policy(config, random.Random(seed))
        self.workers = [SimWorker(i, cost) for i in range(workers)]
        self.ids = [f"w{i}" for i in range(workers)]
        self.index = {wid: i for i, wid in enumerate(self.ids)}
        # A worker's tree cap follows what it caches in both tiers (as the router reads
        # it from heartbeats: kv_capacity_tokens + host_kv_capacity_tokens).
        self.capacity = cost.cache_tokens + cost.host_cache_tokens
        # The columns the policy reads, updated in place as loads change (a FleetView,
        # router/policy/base.py): the policy's cost per decision, not the cost of rebuilding views.
        self.views = FleetView(self.ids, capacities=(self.capacity,) * workers)
        self._heap: list[tuple[float, int, int, Job | int]] = []
        self._seq = 0
        self._rids = 0
        self._done: list[Job] = []
        self._decision_ns: list[int] = []
        self.reasons: Counter[str] = Counter()
        self.rejected = 0
        self._run_cpu_ns = 0
        self._unread: set[int] = set()  # heartbeats the router reads at the next request

    def _push(self, t: float, kind: int, what: Job | int) -> None:
        """An arrival carries its job, a step end its worker's index."""
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, what))

    def _start_step(self, i: int, now: float) -> None:
        worker = self.workers[i]
        end = worker.start_step(now)
        worker.busy = end is not None
        if end is not None:
            self._push(end, _STEP_END, i)

    def _job(self, req: SimRequest, session: int = -1) -> Job:
        self._rids += 1
        out = output_tokens(self._rids, req.out_len)
        return Job(self._rids, req.arrival, req.tokens, out, req.text, session=session,
                   session_key=req.session_key)  # fmt: skip

    def _refresh(self, i: int, now: float) -> None:
        # A heartbeat at every change: loads for every policy, the worker's record
        # (cost_aware's figures) into the view as the router's table writes it. Read at
        # the next request (`_route`), as the simulator always has: its results stay
        # comparable with the ones recorded before the record reached the view.
        worker = self.workers[i]
        views = self.views
        views.loads[i] = worker.load
        cost = worker.cost
        views.reports[i] = WorkerRecord(
            self.ids[i], "sim://", "sim", "sim", 1.0,
            queued_prefill_tokens=worker.queued_prefill_tokens(now),
            prefill_us_per_token=cost.prefill_us_per_token,
            decode_ms_per_token=cost.decode_ms_per_token, max_running_requests=cost.max_running,
            request_ms=worker.request_ms, prompt_tokens_total=worker.prompt_tokens,
            cached_tokens_total=worker.cached_tokens,
            host_kv_capacity_tokens=cost.host_cache_tokens,
            host_cached_tokens_total=worker.host_cached_tokens,
            host_load_bytes_per_s=cost.host_load_bytes_per_s if cost.host_cache_tokens else 0.0,
            kv_bytes_per_token=cost.kv_bytes_per_token,
        )  # fmt: skip
        views.reported += 1
        self._unread.add(i)

    def _route(self, job: Job, now: float) -> None:
        request = RouteRequest(job.text, job.session_key or None)
        for i in self._unread:
            self.views.reported_at[i] = now
        self._unread.clear()
        t0 = time.thread_time_ns()
        decision = self.policy.select(request, self.views, now)
        self._decision_ns.append(time.thread_time_ns() - t0)
        self.reasons[decision.reason] += 1
        i = self.index[decision.worker_id]
        worker = self.workers[i]
        if not worker.fits(job):
            self.rejected += 1  # the live worker answers 400 context_length_exceeded
            return
        worker.submit(job)
        if not worker.busy:
            self._start_step(i, now)
        self._refresh(i, now)

    def run(
        self, source: Iterator[SimRequest] | None = None, closed: ClosedLoop | None = None
    ) -> list[Job]:
        """Replay an open-loop source and/or closed-loop users to the end; returns finished jobs."""
        t0 = time.thread_time_ns()
        try:
            return self._run(source, closed)
        finally:
            self._run_cpu_ns += time.thread_time_ns() - t0

    def _run(self, source: Iterator[SimRequest] | None, closed: ClosedLoop | None) -> list[Job]:
        sessions: list[Session] = []
        tok = self.tokenizer
        if closed is not None:
            workload = Workload(closed.options)
            sessions = [workload.new_session() for _ in range(closed.users)]
            for s, _ in enumerate(sessions):
                self._next_turn(sessions, s, 0.0, tok)
        if source is not None:
            first = next(source, None)
            if first is not None:
                self._push(first.arrival, _ARRIVAL, self._job(first))
        while self._heap:
            now, _, _, what = heapq.heappop(self._heap)
            if isinstance(what, Job):
                self._route(what, now)
                if what.session < 0 and source is not None:
                    nxt = next(source, None)
                    if nxt is not None:
                        self._push(nxt.arrival, _ARRIVAL, self._job(nxt))
                continue
            finished = self.workers[what].finish_step(now)
            self._start_step(what, now)
            self._refresh(what, now)
            for job in finished:
                self._done.append(job)
                if job.session >= 0 and closed is not None:
                    reply = reply_text(job.rid, len(job.out_tokens))
                    sessions[job.session].on_reply(None, reply)  # type: ignore[arg-type]
                    self._next_turn(sessions, job.session, now + closed.think_s, tok)
        return self._done

    def _next_turn(
        self, sessions: list[Session], s: int, now: float, tok: WordTokenizer | LiveTokenizer
    ) -> None:
        req = sessions[s].next_request()
        if req is not None:
            text = req.text()
            sim = SimRequest(now, text, tok.encode(text), req.max_tokens, req.session_id)
            self._push(now, _ARRIVAL, self._job(sim, session=s))

    def result(self, label: str, measure_memory: bool = True) -> SimResult:
        done = self._done
        return SimResult(
            label=label,
            workers=len(self.workers),
            ttft=np.array([j.ttft for j in done]),
            queue=np.array([j.queue_delay for j in done]),
            e2e=np.array([j.finish - j.arrival for j in done]),
            per_worker_requests=np.array([w.requests for w in self.workers]),
            decision_us=np.array(self._decision_ns) / 1e3,
            prompt_tokens=sum(w.prompt_tokens for w in self.workers),
            cached_tokens=sum(w.cached_tokens for w in self.workers),
            preemptions=sum(w.preemptions for w in self.workers),
            rejected=self.rejected,
            makespan=max((j.finish for j in done), default=0.0),
            policy_bytes=deep_size(self.policy) if measure_memory else 0,
            run_cpu_s=self._run_cpu_ns / 1e9,
            reasons=self.reasons,
            host_cached_tokens=sum(w.host_cached_tokens for w in self.workers),
            busy=busy_fraction(self.workers, done),
        )


def busy_fraction(workers: list[SimWorker], done: list[Job]) -> float:
    """Step time over the span from the first arrival to the last finish, all workers."""
    if not done:
        return 0.0
    span = max(j.finish for j in done) - min(j.arrival for j in done)
    return sum(w.busy_s for w in workers) / (len(workers) * span) if span > 0 else 0.0
