"""A simulated worker in virtual time: the engine itself (worker/engine/: scheduler,
radix cache, allocator) over the sim backend's cost model, with the clock passed in.

It is the `--engine sim` worker the live fleet runs (worker/backends/sim.py) minus the
HTTP layer and the sleeping: `CostModelRunner` charges each step `decode_ms` plus
`prefill_us` per prefill token (and the KV its decoders read), and this class turns that charge into virtual time.
So admission (output reservation, in-flight prefix sharing, in-batch dedup, fcfs/lpm),
chunked prefill, eviction and preemption are the engine's own code, not a copy.

A step runs from `start_step(now)` to the time it returns; `finish_step(then)` hands
out what it produced (first tokens, finished jobs), after which the next step starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from worker.backends.sim import (
    DEFAULT_HOST_LOAD_BYTES_PER_S,
    DEFAULT_KV_BYTES_PER_TOKEN,
    CostModelRunner,
    SimModelConfig,
)
from worker.engine.config import EngineConfig
from worker.engine.engine import REQUEST_MS_WEIGHT, LLMEngine
from worker.engine.req import Req
from worker.engine.types import GenerateOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True)
class CostModel:
    prefill_us_per_token: float = 30.0
    decode_ms_per_token: float = 3.0
    max_running: int = 8
    cache_tokens: int = 65_536
    evict_batch: int = 256
    max_prefill_tokens: int = 8192
    schedule_policy: str = "fcfs"
    share_inflight: bool = True
    # The KV every decode step reads (worker/backends/sim.py). The default is
    # Llama-3.2-1B's bytes: 32 KiB of KV per token against 2.47 GB of bf16 weights, so
    # 1,000 context tokens cost 1.33% of a pass over the weights (3 ms -> 40 us); at
    # batch 64 x 2k context the KV is 63% of the step. The engine's CPU steps fit this
    # form (loadtests/results/sim_cost.md).
    decode_us_per_1k_context: float = 40.0
    decode_us_per_seq: float = 0.0
    # The host KV tier (0: off): its capacity in tokens, and a load's price: the KV
    # bytes of a token over the host -> device bandwidth (defaults: an 8B model over
    # PCIe 5, worker/backends/sim.py), added to the step that needs the pages.
    host_cache_tokens: int = 0
    host_load_bytes_per_s: float = DEFAULT_HOST_LOAD_BYTES_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # KV events out of the radix cache (worker/engine/kv_blocks.py), in blocks of this
    # many tokens; 0: off (loadtests/simulate/kv_events.py delivers them to the router).
    kv_events_block_size: int = 0
    # Pins across tool gaps (worker/engine/pins.py): the fraction of KV pins may hold
    # (0: off, today's engine) and the longest TTL granted.
    pin_budget: float = 0.0
    pin_max_ttl_s: float = 300.0

    @property
    def host_load_us_per_token(self) -> float:
        return self.kv_bytes_per_token / self.host_load_bytes_per_s * 1e6

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_running_requests=self.max_running,
            max_prefill_tokens=self.max_prefill_tokens,
            kv_capacity_tokens=self.cache_tokens,
            host_cache_tokens=self.host_cache_tokens,
            evict_batch_tokens=self.evict_batch,
            max_waiting_requests=1 << 30,
            schedule_policy=self.schedule_policy,  # type: ignore[arg-type]
            share_inflight_prefixes=self.share_inflight,
            kv_events_block_size=self.kv_events_block_size,
            pin_budget=self.pin_budget,
            pin_max_ttl_s=self.pin_max_ttl_s,
        )


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
    pin_key: str | None = None  # pin the answer's prefix under this key (pins.py) ...
    pin_ttl: float = 0.0  # ... for this many virtual seconds

    @property
    def queue_delay(self) -> float:
        return self.admitted - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class _Silent:
    def push(self, token_id: int) -> str:
        return ""  # routing needs no text: nothing is detokenized


class _JobSampler:
    """Each job's tokens are fixed in advance (`Job.out_tokens`)."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}  # seq_id -> job, while its request runs

    def sample(self, logits: None, reqs: Sequence[Req]) -> list[tuple[int, TokenLogprob | None]]:
        return [(int(self.jobs[r.seq_id].out_tokens[len(r.output_ids)]), None) for r in reqs]

    def release(self, seq_id: int) -> None:
        del self.jobs[seq_id]


class SimWorker:
    def __init__(self, index: int, cost: CostModel) -> None:
        self.index = index
        self.cost = cost
        capacity = cost.cache_tokens
        self.runner = CostModelRunner(
            capacity,
            SimModelConfig(vocab_size=1 << 62, max_position_embeddings=capacity),
            cost.prefill_us_per_token,
            cost.decode_ms_per_token,
            sleep=None,
            decode_us_per_seq=cost.decode_us_per_seq,
            decode_us_per_1k_context=cost.decode_us_per_1k_context,
            host_capacity=cost.host_cache_tokens,
            host_load_bytes_per_s=cost.host_load_bytes_per_s,
            kv_bytes_per_token=cost.kv_bytes_per_token,
        )
        self._sampler = _JobSampler()
        self.now = 0.0  # virtual time of the step running: the engine's clock (pin TTLs)
        self.engine = LLMEngine(
            self.runner, None, cost.engine_config(), self._sampler, clock=lambda: self.now
        )
        self.cache = self.engine.cache
        self.allocator = self.engine.allocator
        self.busy = False  # a step is in progress (its end is on the fleet's event heap)
        self._by_rid: dict[str, Job] = {}
        self._outputs: list[GenerateOutput] = []
        self._seq_ids = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.host_cached_tokens = 0
        self.busy_s = 0.0  # virtual seconds spent in steps (utilization)
        # How long an admitted job holds its seat, a moving mean in virtual ms, as the
        # live engine reports it (worker/engine/engine.py) to the cost_aware policy.
        self.request_ms = 0.0

    def queued_prefill_tokens(self, now: float) -> int:
        """What its heartbeat would report to cost_aware (as of the last step)."""
        return self.engine.scheduler.queued_prefill_tokens

    @property
    def load(self) -> int:
        """What the router sees: requests in flight to this worker (running + queued)."""
        return len(self._by_rid)

    def fits(self, job: Job) -> bool:
        return len(job.tokens) + len(job.out_tokens) <= self.cost.cache_tokens

    def submit(self, job: Job) -> None:
        job.worker = self.index
        self.requests += 1
        self._seq_ids += 1
        params = SamplingParams(max_tokens=len(job.out_tokens), temperature=0, ignore_eos=True)
        req = Req(str(job.rid), job.tokens.tolist(), params, _Silent(), self._seq_ids)
        if job.pin_key is not None:
            req.pin_key, req.pin_ttl = job.pin_key, job.pin_ttl
        self._sampler.jobs[req.seq_id] = job
        self._by_rid[req.request_id] = job
        self.engine.add([req])

    def start_step(self, now: float) -> float | None:
        """Run one engine step from `now`; the time it ends, or None (nothing ran)."""
        if not self.engine.has_work:
            return None
        self.now = now
        self._outputs = self.engine.step()
        batch = self.engine.last_batch
        for req in batch.admitted:
            job = self._by_rid[req.request_id]  # (its sampler entry may be gone: 1 token)
            if job.admitted < 0:  # not a readmission after a preemption
                job.admitted = now
                job.cached = req.cached_tokens or 0
                self.prompt_tokens += len(job.tokens)
                self.cached_tokens += job.cached
                self.host_cached_tokens += req.host_cached_tokens
        if not batch.items:
            return None
        self.busy_s += self.runner.last_step_s
        return now + self.runner.last_step_s

    def finish_step(self, now: float) -> list[Job]:
        """The step ended at `now`: its tokens arrive; returns the jobs it finished."""
        done = []
        for out in self._outputs:
            job = self._by_rid[out.request_id]
            if job.first_token < 0:
                job.first_token = now
            if out.finished:
                job.finish = now
                done.append(job)
                held_ms = (now - job.admitted) * 1e3
                self.request_ms += REQUEST_MS_WEIGHT * (held_ms - self.request_ms)
                del self._by_rid[out.request_id]
        self._outputs = []
        return done

    @property
    def preemptions(self) -> int:
        return self.engine.scheduler.num_preemptions
