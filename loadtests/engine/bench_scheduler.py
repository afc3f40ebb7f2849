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
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loadtests.engine.bench_engine import random_ids
from shared.tokens.text_tokenizer import TextTokenizer
from worker.backends.sim import build_sim_llm_engine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams

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


def build(backend: str, cfg: EngineConfig, model_dir: Path | None) -> tuple[LLMEngine, _Clock]:
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
            lines += [f"\n{backend}, {workload}\n", _HEADER]
            caps = {"burst": [40_000], "multi_turn": [3_000, 300_000]}[workload]
            running = {"burst": 32, "multi_turn": 8}[workload]
            for cap in caps:
                for name, over in variants.items():
                    cfg = replace(
                        base, kv_capacity_tokens=cap, max_running_requests=running, **over
                    )
                    engine, clock = build(backend, cfg, model_dir)
                    rng = random.Random(0)
                    first, questions = (burst(rng), {}) if workload == "burst" else multi_turn(rng)
                    r = drive(engine, clock, first, questions)
                    r.label = f"{name}" + (f", pool {cap:,}" if workload == "multi_turn" else "")
                    lines.append(r.row())
                    print(lines[-1], flush=True)
    return lines


_HEADER = (
    "| run | requests | prefilled tokens | hit rate | TTFT p50 ms | TTFT p99 ms | preemptions |\n"
    "|---|---|---|---|---|---|---|"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="sim,radix", help="comma list of sim, radix")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")


def main(args: argparse.Namespace) -> int:
    backends = [b for b in args.backend.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None
        if "radix" in backends:
            from worker.models.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", max_position_embeddings=8192)
        lines = run_all(backends, model_dir)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0
