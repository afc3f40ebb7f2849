"""One section of the GPU check, run in its own process by loadtests/gpu/check.py.

A section is a list of steps. `Recorder.step` runs one, stores its result (or its
traceback) and rewrites the section's state file at once, so the parent keeps every
finished step even when this process is killed or dies in a CUDA error; a step that
would start after the deadline is recorded as cut (so is a decode cell).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtests.gpu.report import write

FULL = dict(batches=(1, 32, 64, 128), contexts=(256, 2048), steps=12, prefill=(4, 2048),
            prefix=4096, question=64, prompts=(7, 60, 300), new_tokens=16,
            eager_point=(64, 2048), first_cells=((64, 2048), (1, 2048)),
            overlap_point=(64, 2048, 32, 1), mixed_point=(32, 1024, 512, 10))  # fmt: skip
QUICK = dict(batches=(1, 3), contexts=(16, 40), steps=2, prefill=(2, 32), prefix=64,
             question=8, prompts=(5, 12, 20), new_tokens=4, eager_point=(3, 40),
             first_cells=((3, 40),), overlap_point=(3, 16, 3, 1),
             mixed_point=(2, 8, 12, 1))  # fmt: skip
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy")


class Recorder:
    """A section's results so far, in its state file (for the parent) and merged into
    the report in `out` (for a run killed with no chance to merge: SIGKILL)."""

    def __init__(self, path: Path, deadline: float, out: Path | None = None,
                 name: str = "") -> None:  # fmt: skip
        self.path = path
        self.deadline = deadline
        self.out = out
        self.name = name
        self.data: dict[str, Any] = {"steps_s": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)
        report_file = self.out / "gpu-check.json" if self.out else None
        if report_file is not None and report_file.exists():
            report = json.loads(report_file.read_text())
            unfinished = {"unfinished": "the section had not finished when this was written"}
            report["sections"][self.name] = self.data | unfinished
            write(report_file.parent, report)  # the parent waits: no one else writes

    def step(self, name: str, fn: Callable[[], Any], need_s: float = 2.0) -> Any:
        """Run `fn` as step `name` unless fewer than `need_s` seconds are left."""
        if self.left() < need_s:
            self.data[name] = {"cut": f"time budget ({self.left():.0f} s left)"}
            self.save()
            return None
        print(f"--- {name}", flush=True)
        start = time.time()
        try:
            value = fn()
        except Exception:
            traceback.print_exc()
            value = {"error": traceback.format_exc()[-4000:]}
        self.data[name] = value
        self.data["steps_s"][name] = round(time.time() - start, 1)
        self.save()
        return value


def run_section(args: argparse.Namespace) -> int:
    rec = Recorder(args.state, args.deadline, args.out, args.section)
    device = torch.device(args.device)
    sizes = QUICK if args.quick else FULL
    name = args.section
    if name == "env":
        env_section(rec, device)
    elif name == "correctness":
        from loadtests.gpu.correct import correctness_section

        correctness_section(rec, device, args.quick)
    elif name == "ops":
        from loadtests.gpu.ops import ops_section

        ops_section(rec, device, args.quick)
    elif name == "host_tier":
        from loadtests.gpu.host_tier import host_tier_section

        host_tier_section(rec, device, args.quick)
    elif name.startswith("preset:"):
        preset_section(rec, device, name.split(":", 1)[1], sizes, args.attention_backend)
    else:
        raise ValueError(f"no gpu-check section {name!r}")
    return 0


def env_section(rec: Recorder, device: torch.device) -> None:
    from loadtests.gpu import bench as gb

    def versions() -> dict[str, Any]:
        out: dict[str, Any] = {"python": platform.python_version()}
        for pkg in PACKAGES:
            try:
                out[pkg] = importlib.metadata.version(pkg)
            except importlib.metadata.PackageNotFoundError:
                out[pkg] = "not installed"
        out["torch_cuda"] = torch.version.cuda
        return out

    def gpu() -> dict[str, Any]:
        if device.type != "cuda":
            return {"name": platform.processor() or "cpu"}
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count}  # fmt: skip

    rec.step("versions", versions)
    rec.step("device", gpu)
    rec.step("bandwidth", lambda: gb.bandwidth(device))


def preset_section(rec: Recorder, device: torch.device, preset: str, sizes: dict,
                   backend: str) -> None:  # fmt: skip
    from loadtests.gpu import bench as gb
    from shared.tokens.tokenizer import Tokenizer
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.runtime.runner import ModelRunner
    from worker.engine.runtime.sampler import TorchSampler
    from worker.models.tiny_model import PRESETS, make_tiny_model

    cuda = device.type == "cuda"
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu-check-{preset}-"))
    model_dir = rec.step("model", lambda: str(make_tiny_model(
        tmp, **PRESETS[preset], device=str(device), dtype="bfloat16" if cuda else "float32")))  # fmt: skip
    if not isinstance(model_dir, str):
        return
    batches, contexts, steps = sizes["batches"], sizes["contexts"], sizes["steps"]
    capacity = max(batches) * (max(contexts) + steps + 4)
    holder: dict[str, Any] = {}

    def make_runner(name: str) -> dict[str, Any]:
        holder.clear()
        runner = holder["runner"] = ModelRunner(
            model_dir, device=str(device), kv_capacity_tokens=capacity,
            attention_backend=name, max_running_requests=max(batches))  # fmt: skip
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        return {"dtype": str(runner.dtype).removeprefix("torch."),
                "attention_backend": runner.attention_backend,
                "weight_bytes": gb.weight_bytes(runner),
                "kv_bytes_per_token": gb.kv_bytes_per_token(runner),
                "bandwidth": gb.bandwidth(device)}  # fmt: skip

    def fall_back(why: str) -> dict[str, Any] | None:
        """The table with sdpa (no CUDA graphs) beats no table: when triton fails at
        once (a compile error, say; not a CUDA fault, which would poison this process)."""
        rec.data["fallback"] = f"{why}; what follows ran with the sdpa backend"
        info = rec.step("runner_sdpa", lambda: make_runner("sdpa"), need_s=10)
        return info if isinstance(info, dict) and "error" not in info else None

    info = rec.step("runner", lambda: make_runner(backend), need_s=10)
    if not isinstance(info, dict):  # cut: no time left
        return
    if "error" in info:
        if backend == "sdpa":
            return
        info = fall_back("the runner failed with the triton backend")
        if info is None:
            return
    runner = holder["runner"]
    # Issue 25: every bucket captured when the runner was built, before any traffic.
    rec.step("startup_capture", lambda: gb.startup_capture(runner))
    vocab = min(int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]), 1000)
    prompts = [[4 + (13 * i + 7 * n) % (vocab - 4) for i in range(n)] for n in sizes["prompts"]]

    def greedy() -> None:
        """Greedy tokens vs transformers (fp32, its own engine beside this runner: 80 GB
        hold both), right after the headline cells: "is it correct" before the rest."""
        rec.step("greedy", lambda: gb.greedy_vs_transformers(
            Path(model_dir), device, prompts, sizes["new_tokens"], info["attention_backend"]),
            need_s=25)  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    rec.data["decode"] = cells = []
    order = list(sizes["first_cells"])
    order += [(b, c) for c in contexts for b in batches if (b, c) not in order]
    for index, (batch, context) in enumerate(order):
        if index == len(sizes["first_cells"]):
            greedy()
        cell: dict[str, Any] = {"batch": batch, "context": context}
        cells.append(cell)  # saved with each figure as it comes
        for _attempt in range(2):
            if rec.left() < 4:
                cell["cut"] = "time budget"
                break
            try:
                ms = gb.decode_ms(runner, batch, context, steps)
                floor = 1000 * (info["weight_bytes"] + batch * context * info["kv_bytes_per_token"])
                floor /= info["bandwidth"]["used_bytes_s"]
                # The target: within 1.5x of the floor at the MEASURED copy rate.
                measured = floor * info["bandwidth"]["used_bytes_s"]
                measured /= info["bandwidth"]["measured_copy_bytes_s"]
                cell |= {"ms": round(ms, 3), "roofline_ms": round(floor, 3),
                         "roofline_ratio": round(ms / floor, 2),
                         "measured_floor_ms": round(measured, 3),
                         "measured_ratio": round(ms / measured, 2)}  # fmt: skip
                cell.pop("error", None)
                rec.save()  # the contiguous figure stands even if the fragmented one is cut
                if rec.left() < 4:
                    cell["cut"] = "time budget (the fragmented figure)"
                    break
                # Issue 32: a pool in service is fragmented; both figures, side by side.
                frag = gb.decode_ms(runner, batch, context, steps, fragmented=True)
                cell |= {"fragmented_ms": round(frag, 3),
                         "fragmented_ratio": round(frag / floor, 2),
                         "fragmented_over_contiguous": round(frag / ms, 2)}  # fmt: skip
                break
            except Exception:
                traceback.print_exc()
                cell["error"] = traceback.format_exc()[-2000:]
                first = not any("ms" in c for c in cells)
                if not (first and runner.attention_backend == "triton"):
                    break
                runner = None
                if not (info := fall_back("the first decode cell failed with triton")):
                    rec.save()
                    return
                runner = holder["runner"]
        rec.save()
    if "greedy" not in rec.data:
        greedy()
    rec.step("kernels", lambda: gb.kernels_of_one_step(runner))

    def eager() -> dict[str, Any]:
        batch, context = sizes["eager_point"]
        graphs, runner.graphs = runner.graphs, None
        try:
            return {"batch": batch, "context": context,
                    "ms": round(gb.decode_ms(runner, batch, context, steps), 3)}  # fmt: skip
        finally:
            runner.graphs = graphs

    rec.step("no_capture_in_traffic", lambda: gb.no_capture_in_traffic(runner))
    rec.step("eager_point", eager, need_s=5)
    # Issue 25: a mixed step with piecewise graphs vs eagerly (loadtests/gpu/bench.py).
    rec.step("piecewise_mixed", lambda: gb.piecewise_mixed(runner, *sizes["mixed_point"]),
             need_s=20)  # fmt: skip
    rec.step("overlap_decode", lambda: gb.overlap_decode(runner, Path(model_dir),
                                                         *sizes["overlap_point"]), need_s=30)  # fmt: skip
    rec.data["graph_replays"] = runner.graphs.replays if runner.graphs else 0
    rec.step("prefill_tokens_s", lambda: round(gb.prefill_tokens_s(runner, *sizes["prefill"]), 1),
             need_s=5)  # fmt: skip

    def ttft() -> dict[str, Any]:
        config = EngineConfig(device=str(device), attention_backend=backend)
        engine = LLMEngine(
            runner, Tokenizer.from_dir(model_dir), config, TorchSampler(runner.device)
        )
        out = gb.ttft_cached_vs_uncached(engine, sizes["prefix"], sizes["question"], runs=3)
        return out | {"prefix_tokens": sizes["prefix"]}

    rec.step("ttft", ttft, need_s=10)
    if cuda:  # since the greedy step (its fp32 engine is not this preset's footprint)
        rec.data["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
