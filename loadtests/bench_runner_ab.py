"""Decode step time of this checkout's model runner against another checkout's, paired.

Copies `--base DIR`'s `worker` package (e.g. `git worktree add /tmp/base main`, or
`git archive REV | tar -x -C /tmp/base`) into a temporary folder as `baseworker`, loads
the same random-weight model (the `bench` preset: hidden 512, 8 layers) into both
runners in one process, and alternates: a base measurement, then ours, `--rounds`
times per (batch, context). Each measurement is the median process CPU time of
`--steps` decode steps with 1 torch thread, so other tenants of a shared machine
disturb it far less than wall time; the verdict is the median of the paired ratios.
Our runner gets stable sequence ids (only the new slot moves each step); a base
without them gets its own item type.

    python -m loadtests runner-ab --base /tmp/base [--rounds 11] [--steps 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.engine.allocator import SlotAllocator
from worker.engine.runtime.runner import BatchItem, ModelRunner
from worker.models.tiny_model import PRESETS, make_tiny_model

CASES = ((1, 40), (8, 40), (32, 40), (32, 256))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, required=True, help="another checkout's root folder")
    p.add_argument("--rounds", type=int, default=11, help="paired rounds (default: %(default)s)")
    p.add_argument(
        "--steps", type=int, default=8, help="steps per measurement (default: %(default)s)"
    )


def load_base(root: Path, tmp: Path) -> Any:
    """The base checkout's runner module, imported as `baseworker.engine.runner`."""
    shutil.copytree(root / "worker", tmp / "baseworker")
    for path in (tmp / "baseworker").rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) worker\.", r"\1 baseworker.", text))
    sys.path.insert(0, str(tmp))
    return importlib.import_module("baseworker.engine.runner")


def step_ms(runner: Any, item_type: Any, batch: int, context: int, steps: int) -> float:
    stable = "seq_id" in {f.name for f in dataclasses.fields(item_type)}
    alloc = SlotAllocator(runner.pool.capacity)
    alloc.reset()
    slots = [alloc.alloc(context + steps + 1) for _ in range(batch)]

    def extra(i: int, pos: int) -> dict[str, int]:
        return {"seq_id": i, "dirty_from": pos} if stable else {}

    runner.forward([item_type([5] * context, 0, slots[i][:context], **extra(i, 0))
                    for i in range(batch)])  # fmt: skip
    times = []
    for s in range(steps):
        pos = context + s
        items = [item_type([5], pos, slots[i][: pos + 1], **extra(i, pos)) for i in range(batch)]
        start = time.process_time()
        runner.forward(items)
        times.append(time.process_time() - start)
    if stable:
        for i in range(batch):
            runner.release(i)
    return 1000 * statistics.median(times)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 2:
        raise ValueError("--rounds must be at least 2 (the verdict is a median of pairs)")
    torch.set_num_threads(1)
    lines = ["| batch | context | base ms/step | ours ms/step | ours / base (paired median, quartiles) |",
             "|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base.resolve(), Path(tmp))
        model_dir = make_tiny_model(Path(tmp) / "bench", **PRESETS["bench"])
        capacity = max(b * (c + args.steps + 1) for b, c in CASES)
        runners = [
            (base.ModelRunner(model_dir, device="cpu", kv_capacity_tokens=capacity), base.BatchItem),
            (ModelRunner(model_dir, device="cpu", kv_capacity_tokens=capacity), BatchItem),
        ]  # fmt: skip
        for batch, context in CASES:
            ms: list[list[float]] = [[], []]
            for _ in range(args.rounds):
                for k, (runner, item_type) in enumerate(runners):
                    ms[k].append(step_ms(runner, item_type, batch, context, args.steps))
            ratios = [b / a for a, b in zip(*ms, strict=True)]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            lines.append(f"| {batch} | {context} | {statistics.median(ms[0]):.2f} | "
                         f"{statistics.median(ms[1]):.2f} | {statistics.median(ratios):.3f} "
                         f"({q1:.3f}-{q3:.3f}) |")  # fmt: skip
            print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0
