"""A simulated worker in virtual time: the engine itself (worker/engine/: scheduler,
radix cache, allocator) over the sim backend's cost model, with the clock passed in.

It is the `--engine sim` worker the live fleet runs (worker/backends/sim.py) minus the
HTTP layer and the sleeping: `CostModelRunner` charges each step `decode_ms` plus
`prefill_us` per prefill token (and the KV its decoders read), and this class turns that charge into virtual time.
So admission (output reservation, in-flight prefix sharing, in-batch dedup, fcfs/lpm),
chunked prefill, eviction and preemption are the engine's own code, not a copy.

A step runs from `start_step(now)` to the time it returns; `finish_step(then)` hands
out what it produced (first tokens, finished jobs), after which the next step starts.

`sim-calibrate` (SIM_CALIBRATE below) fits the sim's step price to the CPU model runner's
steps.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtests.kit import Command, write_table
from worker.backends.sim import (
    DEFAULT_HOST_LOAD_BYTES_PER_S,
    DEFAULT_KV_BYTES_PER_TOKEN,
    CostModelRunner,
    SimModelConfig,
)
from worker.engine.batch import BatchItem
from worker.engine.config import EngineConfig
from worker.engine.engine import REQUEST_MS_WEIGHT, LLMEngine
from worker.engine.req import Req
from worker.engine.types import GenerateOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from collections.abc import Sequence

    from worker.engine.runtime.runner import ModelRunner


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
    # many tokens; 0: off (loadtests/simulate/divergence.py delivers them to the router).
    kv_events_block_size: int = 0
    # Pins across tool gaps (worker/engine/pins.py): the fraction of KV pins may hold
    # (0: off, today's engine) and the longest TTL granted.
    pin_budget: float = 0.0
    pin_max_ttl_s: float = 300.0
    # The radix cache's capped second chance (worker/engine/radix_cache.py), every side.
    second_chance: float = EngineConfig.second_chance

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
            second_chance=self.second_chance,
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
    session_key: str = ""  # the x-session-id the live client sends (consistent_hash's key)
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


# -- sim-calibrate -----------------------------------------------------------------------
def step_ms(runner: ModelRunner, batch: int, context: int, reps: int) -> float:
    """Median ms of a decode step of `batch` sequences, each at `context` tokens."""
    items = [
        BatchItem([7], context - 1, np.arange(i * context, (i + 1) * context), i, 0)
        for i in range(batch)
    ]
    runner.forward(items)  # writes the table rows (and warms up)
    for it in items:
        it.dirty_from = it.start_pos  # then only the new token's slot moves, as in serving
    times = []
    for _ in range(reps):
        start = time.process_time()
        runner.forward(items)
        times.append((time.process_time() - start) * 1e3)
    for it in items:
        runner.release(it.seq_id)
    return statistics.median(times)


def fit(points: list[tuple[int, int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """[decode_ms, us per seq, us per 1k context] and the fitted ms at each point."""
    x = np.array([[1.0, b / 1e3, b * c / 1e6] for b, c, _ in points])
    y = np.array([ms for _, _, ms in points])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return coef, x @ coef


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--reps", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=None, help="append the table here")


def calibrate_main(args: argparse.Namespace) -> int:
    # torch and the model runner only here: the simulator itself runs without torch.
    import torch

    from worker.engine.runtime.runner import ModelRunner
    from worker.models.tiny_model import PRESETS, make_tiny_model

    torch.set_num_threads(args.threads)
    capacity = max(args.batches) * max(args.contexts) + 1
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "bench", **PRESETS["bench"])
        runner = ModelRunner(
            model_dir, device="cpu", dtype="float32", kv_capacity_tokens=capacity,
            max_running_requests=max(args.batches),
        )  # fmt: skip
        for b, c in itertools.product(args.batches, args.contexts):
            points.append((b, c, step_ms(runner, b, c, args.reps)))
    coef, fitted = fit(points)
    y = np.array([ms for *_, ms in points])
    r2 = 1 - float(((y - fitted) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    lines = [
        f"Fit: step_ms = {coef[0]:.3f} + {coef[1]:.1f} us x batch + {coef[2]:.2f} us x "
        f"context/1k (R^2 {r2:.3f}; bench preset, CPU, {args.threads} torch thread(s))",
        "",
        "| batch | context | measured ms | fitted ms | error |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {b} | {c} | {ms:.2f} | {f:.2f} | {(f - ms) / ms:+.1%} |"
            for (b, c, ms), f in zip(points, fitted, strict=True)
        ),
        "",
        f"As sim flags: --sim-decode-ms-per-token {coef[0]:.3f} --sim-decode-us-per-seq "
        f"{max(coef[1], 0):.1f} --sim-decode-us-per-1k-context {max(coef[2], 0):.2f}",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        write_table(args.out, args.command_line, table)
    return 0


SIM_CALIBRATE = Command(
    """Fit the sim backend's step price to the engine's own CPU decode steps.

The sim cost model (worker/backends/sim.py) prices a decode step as

    step_ms = decode_ms + decode_us_per_seq x batch / 1e3
              + decode_us_per_1k_context x (context tokens / 1e3) / 1e3

This runs the real `ModelRunner` (random-weight Llama, the `bench` preset, CPU) on
decode-only batches over a grid of batch sizes and context lengths, times each
step (median of a few, on the process's CPU clock with one torch thread: what other
tenants of a shared box disturb least), fits the three coefficients by least squares
on relative error (a 50 ms step matters as much as a 1 s one) and prints them with the
fit's error at every point. The fit's coefficients are what `--engine sim` would need to stand in for
this CPU engine; the fleet simulator's defaults come from a GPU's bytes instead
(loadtests/simulate/worker.py). Each sequence has its own slots, so the KV really is read.

    python -m loadtests sim-calibrate [--batches 1 16 32 64] [--contexts 128 512 1024]
""",
    calibrate_arguments,
    calibrate_main,
)
