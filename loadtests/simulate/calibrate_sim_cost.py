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
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from loadtests.options import HelpFormatter
from loadtests.record import write_table
from worker.engine.batch import BatchItem
from worker.engine.runtime.runner import ModelRunner
from worker.models.tiny_model import PRESETS, make_tiny_model


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--reps", type=int, default=3, help="timed steps per point (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="append the table here")
    args = parser.parse_args(argv)
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
        write_table(args.out, "sim-calibrate", argv, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
