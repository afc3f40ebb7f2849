"""The engine on CPU, on tiny random-weight models: what the radix cache saves on time to
first token and decode speed (`engine`, below), host work per decode step at batch 64
(`host-step`, HOST_STEP) and what the scheduler's choices save (`scheduler`, SCHEDULER).

`engine`:

Builds a random-weight Llama (hidden 512, 8 layers: tiny_model's `bench` preset) in a
temp dir, then measures side by side in one run, on the same engine and model:

- TTFT of a 2,048-token shared prefix + 64-token question, uncached (cache flushed
  first) vs cached (the prefix is in the radix tree from the previous request, only the
  question is prefilled). Runs interleave so machine noise hits both alike; medians.
- Decode tokens/s at batch 1, 8 and 32 (steady state: every request already prefilled).

    python -m loadtests engine [--runs 5] [--threads 1] [--out loadtests/results/engine.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadtests.kit import Command, write_table
from shared.tokens.text_tokenizer import TextTokenizer
from worker.backends.sim import build_sim_llm_engine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams
from worker.models.tiny_model import PRESETS, make_tiny_model

# Decode timing clock: wall time by default; `--clock process` counts this process's
# CPU time instead, which other tenants of a shared machine disturb far less (with
# --threads 1 it is the work the step did).
CLOCK = {"wall": time.perf_counter, "process": time.process_time}
clock = CLOCK["wall"]

PREFIX_TOKENS = 2048
QUESTION_TOKENS = 64


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    """`n` token ids of the tiny models' vocabulary (0..3: their special tokens)."""
    return tuple(rng.randrange(4, 1000) for _ in range(n))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def ttft(engine: LLMEngine, rid: str, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the cached tokens reported."""
    start = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt_token_ids=prompt, params=_params(1)))
    while True:
        outs = engine.step()
        if outs:
            elapsed = time.perf_counter() - start
            while engine.has_work:  # nothing left with max_tokens=1, but be sure
                engine.step()
            return elapsed, outs[0].cached_tokens


def bench_ttft(engine: LLMEngine, runs: int) -> dict[str, float]:
    rng = random.Random(0)
    prefix = random_ids(rng, PREFIX_TOKENS)
    uncached, cached, hits = [], [], []
    for i in range(runs):
        engine.flush_cache()
        t, hit = ttft(engine, f"u{i}", prefix + random_ids(rng, QUESTION_TOKENS))
        assert hit == 0, hit
        uncached.append(t)
        # The previous request left the prefix in the tree; a new question follows it.
        t, hit = ttft(engine, f"c{i}", prefix + random_ids(rng, QUESTION_TOKENS))
        cached.append(t)
        hits.append(hit)
    return {
        "uncached_s": statistics.median(uncached),
        "cached_s": statistics.median(cached),
        "cached_tokens": statistics.median(hits),
    }


class ForwardTimer:
    """Wraps the runner's forward to split step time into model time and engine overhead
    (scheduling, sampling, detokenizing, bookkeeping)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self._forward = engine.runner.forward
        engine.runner.forward = self

    def __call__(self, batch: list) -> object:
        start = clock()
        try:
            return self._forward(batch)
        finally:
            self.seconds += clock() - start


def bench_decode(
    engine: LLMEngine, timer: ForwardTimer, batch: int, steps: int
) -> tuple[float, float]:
    """Decode tokens/s with `batch` requests decoding together, and the share of step
    time spent outside the model."""
    engine.flush_cache()
    rng = random.Random(batch)
    for i in range(batch):
        prompt = random_ids(rng, 32)
        engine.add_request(
            EngineRequest(f"d{batch}-{i}", prompt_token_ids=prompt, params=_params(steps + 2))
        )
    produced = 0
    while produced < batch:  # prefill every request (each yields its first token)
        produced += len(engine.step())
    start, model_before = clock(), timer.seconds
    tokens = 0
    for _ in range(steps):
        tokens += len(engine.step())
    elapsed = clock() - start
    overhead = 1 - (timer.seconds - model_before) / elapsed
    while engine.has_work:
        engine.step()
    return tokens / elapsed, overhead


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="TTFT runs (median)")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    p.add_argument("--clock", choices=sorted(CLOCK), default="wall", help="decode timing")
    p.add_argument(
        "--skip-ttft", action="store_true", help="decode only (for quick A/B runs of decode speed)"
    )


def main(args: argparse.Namespace) -> int:
    global clock
    clock = CLOCK[args.clock]
    if args.threads is not None:
        # On a shared, oversubscribed CPU one thread per process avoids threads waiting
        # on descheduled siblings inside every small matmul.
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "bench-llama", **PRESETS["bench"])
        config = EngineConfig(kv_capacity_tokens=16384, device=args.device)
        engine = load_engine(model_dir, config)
        ttft(engine, "warmup", random_ids(random.Random(9), 256))  # first-call allocations
        t = (
            {"uncached_s": float("nan"), "cached_s": float("nan"), "cached_tokens": 0}
            if args.skip_ttft
            else bench_ttft(engine, args.runs)
        )
        timer = ForwardTimer(engine)
        decode = {b: bench_decode(engine, timer, b, args.decode_steps) for b in (1, 8, 32)}

    ratio = t["cached_s"] / t["uncached_s"]
    shape = PRESETS["bench"]
    lines = [
        f"Model: random-weight Llama, hidden {shape['hidden_size']}, {shape['num_layers']} layers, "
        f"device {engine.runner.device}, dtype {engine.runner.dtype}, "
        f"torch threads {torch.get_num_threads()}, "
        f"max_prefill_tokens {config.max_prefill_tokens}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| TTFT uncached, {PREFIX_TOKENS}+{QUESTION_TOKENS} tokens (median of {args.runs}) "
        f"| {t['uncached_s'] * 1000:.1f} ms |",
        f"| TTFT cached prefix ({t['cached_tokens']:.0f} tokens hit) | {t['cached_s'] * 1000:.1f} ms |",
        f"| cached / uncached | {ratio:.3f} (target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'}) |",
        *(
            f"| decode tokens/s, batch {b} (engine overhead {share:.1%} of step time) | {tps:.1f} |"
            for b, (tps, share) in decode.items()
        ),
        f"| decode batch 32 / batch 1 | {decode[32][0] / decode[1][0]:.1f}x |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        write_table(args.out, args.command_line, table, title="Engine benchmark")
    return 0


# -- host-step ---------------------------------------------------------------------------
VARIANTS = {  # name: EngineConfig keywords
    "before": dict(debug_checks=True, overlap_schedule=False),
    "checks off": dict(debug_checks=False, overlap_schedule=False),
    "overlap": dict(debug_checks=False, overlap_schedule=True),
}
host_clock = time.process_time  # one torch thread: the work this process did


class DeviceTimer:
    """Seconds spent in what a GPU would run: wraps the given bound methods."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner: Any, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = host_clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += host_clock() - start

        setattr(owner, name, timed)


def build(model_dir: Path, batch: int, context: int, steps: int, **cfg: Any) -> LLMEngine:
    config = EngineConfig(
        device="cpu", max_running_requests=batch, max_prefill_tokens=batch * context,
        kv_capacity_tokens=batch * (context + steps + 8) + 64, **cfg,
    )  # fmt: skip
    return load_engine(model_dir, config)


def measure(
    engine: LLMEngine, batch: int, context: int, steps: int, tag: str
) -> tuple[float, float]:
    """Median host ms per decode step, and decode tokens/s (wall), over `steps`."""
    timer = DeviceTimer()
    timer.wrap(engine.runner, "run_eager")
    timer.wrap(engine.runner.model, "compute_logits")
    timer.wrap(engine.sampler, "_packed")
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [4 + (i * 131 + j * 7) % 1000 for j in range(context)]  # distinct prompts
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt_token_ids=prompt, params=params))
    while not (len(engine.last_batch.items) == batch and engine.last_batch.items[0].start_pos):
        engine.step()  # prefill (then every item is one decode token)
    host, tokens = [], 0
    wall = time.perf_counter()
    for _ in range(steps):
        device_before, start = timer.seconds, host_clock()
        tokens += len(engine.step())
        host.append((host_clock() - start - (timer.seconds - device_before)) * 1e3)
    wall = time.perf_counter() - wall
    while engine.has_work:
        engine.step()
    return statistics.median(host), tokens / wall


def host_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--out", type=Path, default=None, help="append the table here")


def host_step_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", **PRESETS["tiny"])
        engines = {
            name: build(model_dir, args.batch, args.context, args.steps, **cfg)
            for name, cfg in VARIANTS.items()
        }
        for r in range(args.rounds):
            for name, engine in engines.items():
                results[name].append(
                    measure(engine, args.batch, args.context, args.steps, f"{r}{name}")
                )
    base = statistics.median(h for h, _ in results["before"])
    lines = [
        f"Batch {args.batch} decode steps, {args.context}-token prompts, tiny preset, CPU, "
        f"1 torch thread; median of {args.rounds} rounds x {args.steps} steps",
        "",
        "| engine | host ms / step | vs before | decode tok/s (wall) | per round (host ms) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, runs in results.items():
        host = statistics.median(h for h, _ in runs)
        tps = statistics.median(t for _, t in runs)
        each = " / ".join(f"{h:.2f}" for h, _ in runs)
        lines.append(f"| {name} | {host:.2f} | {host / base:.2f}x | {tps:.0f} | {each} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        write_table(args.out, args.command_line, table)
    return 0


HOST_STEP = Command(
    """Host work per decode step at batch 64: what the GPU would wait for between steps.

A decode step's host work is everything but the device's: scheduling, the runner's
batch packing (and its validation), the sampler's host side, postprocessing (stop
checks, detokenizing, outputs). On CPU the device work runs on the host too, so
this times the model's forward, its logits and the sampler's tensor ops separately
and subtracts them from the step:

    host ms = step - model forward - logits - sampler tensor ops

Three engines over the same model (random weights, the `tiny` preset: a small
forward keeps the subtraction's noise small; host work does not depend on the model's
size), measured in interleaved rounds in one run, medians:

- `before`: per-step validation on (`debug_checks`, the state before issue 25), in order
- `checks off`: validation in debug mode only (the default now), in order
- `overlap`: checks off, overlap scheduling on (the default now)

What the CPU number does NOT show: overlap hides host work behind the device's
forward; on CPU the forward runs on the host, so nothing runs concurrently and the
overlap engine's host work per step is about the in-order one's. The tokens/s column
is therefore about equal on CPU; on a GPU the host work of `overlap` runs while the
device computes (the GPU check's overlap section measures that).

    python -m loadtests host-step [--batch 64] [--steps 20] [--rounds 3] [--context 256]
""",
    host_step_arguments,
    host_step_main,
)


# -- scheduler ---------------------------------------------------------------------------
PREFILL_US, DECODE_MS = 30.0, 3.0  # the sim cost model (a mid-size model on one GPU)


@dataclass(frozen=True)
class Turn:
    rid: str
    prompt: list[int]
    max_tokens: int
    conversation: int = -1  # closed loop: the next turn follows this one's answer
    question: tuple[int, ...] = ()  # the next turn's new tokens


def burst(rng: random.Random) -> list[Turn]:
    prefix = list(random_ids(rng, 2000))
    return [Turn(f"b{i}", [*prefix, *list(random_ids(rng, 50))], 16) for i in range(16)]


def multi_turn(rng: random.Random) -> tuple[list[Turn], dict[int, list[list[int]]]]:
    system = list(random_ids(rng, 200))
    questions = {c: [list(random_ids(rng, 40)) for _ in range(5)] for c in range(24)}
    first = [Turn(f"c{c}-0", [*system, *qs[0]], 24, c) for c, qs in questions.items()]
    return first, questions


@dataclass
class Result:
    label: str
    prefilled: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    preemptions: int
    requests: int

    def row(self) -> str:
        return (
            f"| {self.label} | {self.requests} | {self.prefilled:,} | {self.hit_rate:.1%} "
            f"| {self.ttft_p50_ms:.1f} | {self.ttft_p99_ms:.1f} | {self.preemptions} |"
        )


def drive(engine: LLMEngine, clock: _Clock, first: list[Turn], questions: dict) -> Result:
    """Run to the end; closed-loop turns are sent when the previous answer is complete."""
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    turns = {t.rid: t for t in first}
    for t in first:
        _send(engine, t, sent, clock)
    decode_inputs = 0
    while engine.has_work:
        for out in engine.step():
            clock.tick(engine)
            answers.setdefault(out.request_id, []).extend(out.token_ids)
            ttft.setdefault(out.request_id, clock.now() - sent[out.request_id])
            if out.finished:
                turn = turns[out.request_id]
                decode_inputs += len(answers[turn.rid]) - 1
                nxt = _next_turn(turn, answers[turn.rid], questions)
                if nxt is not None:
                    turns[nxt.rid] = nxt
                    _send(engine, nxt, sent, clock)
        clock.tick(engine)
    stats = engine.stats()
    values = np.array(list(ttft.values())) * 1e3
    return Result(
        label="",
        prefilled=engine.runner.tokens_computed - decode_inputs,
        hit_rate=stats.cached_tokens_total / stats.prompt_tokens_total,
        ttft_p50_ms=float(np.percentile(values, 50)),
        ttft_p99_ms=float(np.percentile(values, 99)),
        preemptions=stats.preemptions_total,
        requests=len(ttft),
    )


def _send(engine: LLMEngine, t: Turn, sent: dict[str, float], clock: _Clock) -> None:
    params = SamplingParams(max_tokens=t.max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(t.rid, prompt_token_ids=tuple(t.prompt), params=params))
    sent[t.rid] = clock.now()


def _next_turn(turn: Turn, answer: list[int], questions: dict) -> Turn | None:
    if turn.conversation < 0:
        return None
    c = turn.conversation
    k = int(turn.rid.rsplit("-", 1)[1]) + 1
    if k >= len(questions[c]):
        return None
    return Turn(f"c{c}-{k}", [*turn.prompt, *answer, *questions[c][k]], turn.max_tokens, c)


class _Clock:
    """Virtual time for the cost model (the runner's step cost), wall time for a model."""

    def __init__(self, virtual: bool) -> None:
        self.virtual = virtual
        self.t = 0.0
        self._steps = -1

    def tick(self, engine: LLMEngine) -> None:
        if self.virtual and engine.scheduler.steps != self._steps:
            self._steps = engine.scheduler.steps
            self.t += engine.runner.last_step_s

    def now(self) -> float:
        return self.t if self.virtual else time.perf_counter()


def scheduler_engine(
    backend: str, cfg: EngineConfig, model_dir: Path | None
) -> tuple[LLMEngine, _Clock]:
    if backend == "sim":
        engine = build_sim_llm_engine(
            cfg, TextTokenizer(), prefill_us_per_token=PREFILL_US, decode_ms_per_token=DECODE_MS,
            sleep=None,
        )  # fmt: skip
        return engine, _Clock(virtual=True)
    assert model_dir is not None
    return load_engine(model_dir, cfg), _Clock(virtual=False)


def run_all(backends: list[str], model_dir: Path | None) -> list[str]:
    lines = []
    base = EngineConfig(max_running_requests=32, max_prefill_tokens=4096, device="cpu")
    variants = {
        "fcfs, sharing on": {},
        "lpm, sharing on": {"schedule_policy": "lpm"},
        "fcfs, sharing off": {"share_inflight_prefixes": False},
        "lpm, sharing off": {"schedule_policy": "lpm", "share_inflight_prefixes": False},
    }
    for backend in backends:
        for workload in ("burst", "multi_turn"):
            lines += [f"\n{backend}, {workload}\n", SCHEDULER_HEADER]
            caps = {"burst": [40_000], "multi_turn": [3_000, 300_000]}[workload]
            running = {"burst": 32, "multi_turn": 8}[workload]
            for cap in caps:
                for name, over in variants.items():
                    cfg = replace(
                        base, kv_capacity_tokens=cap, max_running_requests=running, **over
                    )
                    engine, clock = scheduler_engine(backend, cfg, model_dir)
                    rng = random.Random(0)
                    first, questions = (burst(rng), {}) if workload == "burst" else multi_turn(rng)
                    r = drive(engine, clock, first, questions)
                    r.label = f"{name}" + (f", pool {cap:,}" if workload == "multi_turn" else "")
                    lines.append(r.row())
                    print(lines[-1], flush=True)
    return lines


SCHEDULER_HEADER = (
    "| run | requests | prefilled tokens | hit rate | TTFT p50 ms | TTFT p99 ms | preemptions |\n"
    "|---|---|---|---|---|---|---|"
)


def scheduler_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="sim,radix", help="comma list of sim, radix")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")


def scheduler_main(args: argparse.Namespace) -> int:
    backends = [b for b in args.backend.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None
        if "radix" in backends:
            model_dir = make_tiny_model(Path(tmp) / "tiny", max_position_embeddings=8192)
        lines = run_all(backends, model_dir)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


SCHEDULER = Command(
    """Scheduler benchmark: one worker, the sim backend (cost model, virtual time) and the
radix backend (tiny model, wall time), fcfs vs lpm, in-flight sharing on vs off.

Workloads, both as token ids:

- `burst`: 16 requests at once sharing a 2,000-token prefix, each with its own
  50-token suffix, 16 output tokens. Ideal prefill: 2,000 + 16 x 50.
- `multi_turn`: 24 conversations, 5 turns each, closed loop (the next turn is sent
  when the previous answer arrives), at most 8 running: a shared 200-token system
  prompt, 40-token questions, 24-token answers. A 3,000-token pool holds under half
  the working set (~7,900 tokens), so hits depend on what the scheduler keeps; the
  ceiling is the same run with a 300,000-token pool (no eviction).

Per run: prefilled tokens (counted by the runner: every token it computed minus one
decode input per later output token), prefix hit rate (cached / prompt tokens), TTFT
p50 / p99, preemptions.

    python -m loadtests scheduler [--backend sim,radix] [--out loadtests/results/scheduler.md]
""",
    scheduler_arguments,
    scheduler_main,
)
