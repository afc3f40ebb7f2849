"""Engine benchmark: what the radix cache saves on time to first token, and decode speed.

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
from pathlib import Path

import torch

from loadtests.options import HelpFormatter
from loadtests.record import write_table
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


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(4, 1000) for _ in range(n))  # 0..3: special tokens


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
    prefix = _ids(rng, PREFIX_TOKENS)
    uncached, cached, hits = [], [], []
    for i in range(runs):
        engine.flush_cache()
        t, hit = ttft(engine, f"u{i}", prefix + _ids(rng, QUESTION_TOKENS))
        assert hit == 0, hit
        uncached.append(t)
        # The previous request left the prefix in the tree; a new question follows it.
        t, hit = ttft(engine, f"c{i}", prefix + _ids(rng, QUESTION_TOKENS))
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
        prompt = _ids(rng, 32)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="TTFT runs (median)")
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall", help="decode timing")
    parser.add_argument(
        "--skip-ttft", action="store_true", help="decode only (for quick A/B runs of decode speed)"
    )
    args = parser.parse_args(argv)
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
        ttft(engine, "warmup", _ids(random.Random(9), 256))  # first-call allocations
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
        write_table(args.out, "engine", argv, table, title="Engine benchmark")
    return 0
