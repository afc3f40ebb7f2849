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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtests.options import HelpFormatter
from loadtests.record import write_table
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams
from worker.models.tiny_model import PRESETS, make_tiny_model

VARIANTS = {  # name: EngineConfig keywords
    "before": dict(debug_checks=True, overlap_schedule=False),
    "checks off": dict(debug_checks=False, overlap_schedule=False),
    "overlap": dict(debug_checks=False, overlap_schedule=True),
}
clock = time.process_time  # one torch thread: the work this process did


class DeviceTimer:
    """Seconds spent in what a GPU would run: wraps the given bound methods."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner: Any, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += clock() - start

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
        device_before, start = timer.seconds, clock()
        tokens += len(engine.step())
        host.append((clock() - start - (timer.seconds - device_before)) * 1e3)
    wall = time.perf_counter() - wall
    while engine.has_work:
        engine.step()
    return statistics.median(host), tokens / wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--out", type=Path, default=None, help="append the table here")
    args = parser.parse_args(argv)
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
        write_table(args.out, "host-step", argv, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
