"""A simulated worker in virtual time: the real RadixCache and the sim engine's cost model.

It mirrors `worker/backends/sim.py` (the `--engine sim` worker the live fleet runs), with
the clock passed in instead of `asyncio.sleep`:

- at most `max_running` requests run at once, the rest wait in FIFO order;
- admission matches the prompt (all but its last token) in the radix cache, locks the
  path and reserves the uncached suffix + the output; when slots run short it evicts
  least-recently-used unlocked prefixes, in batches of at least `evict_batch` tokens,
  and a request that still does not fit waits at the head of the line;
- a running request takes `prefill_us × uncached tokens` then `decode_ms` per output
  token; its first token arrives after the prefill and one decode step;
- on finish, prompt + output go into the tree and the unused slots are freed.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.radix_cache import RadixCache


@dataclass(frozen=True)
class CostModel:
    prefill_us_per_token: float = 30.0
    decode_ms_per_token: float = 3.0
    max_running: int = 8
    cache_tokens: int = 65_536
    evict_batch: int = 256


@dataclass(eq=False)
class Job:
    """One request's life in the simulation. Times are virtual seconds."""

    rid: int
    arrival: float
    tokens: np.ndarray  # prompt token ids
    out_tokens: np.ndarray  # the ids it will generate (inserted into the cache at the end)
    text: str  # what the router routes on
    worker: int = -1
    admitted: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    cached: int = 0
    session: int = -1  # closed-loop user that sent it (-1: open loop)
    _slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    _node: object = None

    @property
    def queue_delay(self) -> float:
        return self.admitted - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class SimWorker:
    def __init__(self, index: int, cost: CostModel) -> None:
        self.index = index
        self.cost = cost
        self.allocator = SlotAllocator(cost.cache_tokens)
        self.cache = RadixCache(self.allocator)
        self.waiting: deque[Job] = deque()
        self.running = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # What its heartbeat would report to cost_aware: prompt tokens waiting, plus the
        # uncached tokens of running jobs still in prefill (a heap of their prefill ends).
        self._waiting_tokens = 0
        self._prefilling: list[tuple[float, int]] = []
        self._prefilling_tokens = 0
        self.request_ms = 0.0  # how long an admitted job holds its seat: moving mean, as
        # worker/backends/sim.py reports it

    @property
    def load(self) -> int:
        """What the router sees: requests in flight to this worker (running + queued)."""
        return self.running + len(self.waiting)

    def queued_prefill_tokens(self, now: float) -> int:
        heap = self._prefilling
        while heap and heap[0][0] <= now:
            self._prefilling_tokens -= heapq.heappop(heap)[1]
        return self._waiting_tokens + self._prefilling_tokens

    def fits(self, job: Job) -> bool:
        return len(job.tokens) + len(job.out_tokens) <= self.cost.cache_tokens

    def submit(self, job: Job, now: float) -> list[Job]:
        """Queue a job; returns the jobs admitted now (their times are set)."""
        job.worker = self.index
        self.requests += 1
        self.waiting.append(job)
        self._waiting_tokens += len(job.tokens)
        return self._admit(now)

    def complete(self, job: Job, now: float) -> list[Job]:
        """The job finished at `now`: cache its tokens, free the rest, admit more."""
        all_ids = np.concatenate([job.tokens, job.out_tokens])
        n = len(all_ids)
        self.cache.insert(all_ids, job._slots[:n], cached_len=job.cached)
        self.allocator.free(job._slots[n:])
        self.cache.unlock(job._node)  # type: ignore[arg-type]
        job._slots = job._slots[:0]
        self.running -= 1
        self.request_ms += 0.1 * ((now - job.admitted) * 1e3 - self.request_ms)
        return self._admit(now)

    def _admit(self, now: float) -> list[Job]:
        started: list[Job] = []
        cost = self.cost
        while self.waiting and self.running < cost.max_running:
            job = self.waiting[0]
            if not self._reserve(job):
                break  # head-of-line waits for KV; the next completion retries
            self.waiting.popleft()
            self.running += 1
            uncached = len(job.tokens) - job.cached
            prefill = cost.prefill_us_per_token * uncached / 1e6
            self._waiting_tokens -= len(job.tokens)
            heapq.heappush(self._prefilling, (now + prefill, uncached))
            self._prefilling_tokens += uncached
            step = cost.decode_ms_per_token / 1e3
            job.admitted = now
            job.first_token = now + prefill + step
            job.finish = now + prefill + step * len(job.out_tokens)
            started.append(job)
        return started

    def _reserve(self, job: Job) -> bool:
        match = self.cache.match_prefix(job.tokens[:-1])
        self.cache.lock(match.last_node)
        need = len(job.tokens) - match.prefix_len + len(job.out_tokens)
        slots = self.allocator.alloc(need)
        if slots is None:
            shortfall = need - self.allocator.available
            self.cache.evict(max(shortfall, self.cost.evict_batch))
            slots = self.allocator.alloc(need)
            if slots is None:
                self.cache.unlock(match.last_node)
                return False
        job._slots = np.concatenate([match.slots, slots])
        job._node = match.last_node
        job.cached = match.prefix_len
        self.prompt_tokens += len(job.tokens)
        self.cached_tokens += match.prefix_len
        return True
