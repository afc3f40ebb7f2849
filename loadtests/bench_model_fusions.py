"""CPU side-by-side of the model's load-time fusions (the GPU side is in gpu-check).

- merged q/k/v, merged q/k/v + gate/up (`fuse_projections`) and the checkpoint's
  separate projections: decode ms/step through the runner, same weights, same batch;
- RoPE in place (`apply_rope_`) vs transformers' out-of-place form, per call.

Process CPU time, 1 torch thread (a shared machine's other tenants disturb it far less
than wall time), medians of alternating rounds.

    python -m loadtests model-fusions [--rounds 3] [--out loadtests/results/model-fusions.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtests.options import HelpFormatter
from worker.engine.allocator import SlotAllocator
from worker.engine.runtime.model import apply_rope_
from worker.engine.runtime.runner import BatchItem, ModelRunner
from worker.engine.runtime.weights import load_model
from worker.models.tiny_model import PRESETS, make_tiny_model


def decode_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    alloc = SlotAllocator(runner.pool.capacity)
    alloc.reset()
    slots = [alloc.alloc(context + steps) for _ in range(batch)]
    times = []
    for step in range(steps):
        pos = context - 1 + step
        items = [BatchItem([5 + i], pos, slots[i][: pos + 1], seq_id=i, dirty_from=0 if step == 0 else pos)
                 for i in range(batch)]  # fmt: skip
        start = time.process_time()
        runner.forward(items)
        times.append(time.process_time() - start)
    for i in range(batch):
        runner.release(i)
    return 1000 * statistics.median(times[1:])


def rope_us(shape: tuple[int, int, int], reps: int) -> tuple[float, float]:
    x = torch.randn(shape)
    freqs = torch.randn(shape[0], 1, shape[2] // 2)
    cos, sin = freqs.cos(), freqs.sin()
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def copy_form() -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos2 + torch.cat((-x2, x1), dim=-1) * sin2

    out = []
    for fn in (lambda: apply_rope_(x, cos, sin), copy_form):
        start = time.process_time()
        for _ in range(reps):
            fn()
        out.append(1e6 * (time.process_time() - start) / reps)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests model-fusions", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "bench", **PRESETS["bench"])
        runner = ModelRunner(model_dir, device="cpu", kv_capacity_tokens=32 * 300)
        both, separate = (
            load_model(model_dir, runner.config, runner.device, runner.dtype, fuse=False)
            for _ in range(2)
        )
        both.fuse_projections(gate_up=True)
        models = {"q/k/v + gate/up": both, "q/k/v": runner.model, "separate": separate}
        for batch, context in ((1, 256), (8, 256), (32, 256)):
            got: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(args.rounds):
                for name, model in models.items():
                    runner.model = model
                    got[name].append(decode_ms(runner, batch, context, args.steps))
            ms = [statistics.median(got[name]) for name in models]
            cells = " | ".join(f"{m:.2f} ms ({m / ms[-1]:.2f})" for m in ms)
            rows.append(f"| decode batch {batch}, context {context} | {cells} |")
    rope = []
    for shape in ((1, 8, 64), (32, 8, 64), (2048, 8, 64)):
        a, b = rope_us(shape, reps=50)
        rope.append(f"| RoPE on q {list(shape)} | {a:.1f} µs | {b:.1f} µs | {a / b:.2f} |")
    table = "\n".join([
        "| decode step | merged q/k/v + gate/up | merged q/k/v | separate |", "|---|---|---|---|",
        *rows, "", "| RoPE | in place | transformers' form | ratio |", "|---|---|---|---|", *rope,
    ])  # fmt: skip
    print(table)
    if args.out:
        args.out.write_text("# Model fusions on CPU\n\n`python -m loadtests model-fusions`"
                            f" (bench preset, fp32, 1 thread, process CPU time)\n\n{table}\n")  # fmt: skip
    return 0
