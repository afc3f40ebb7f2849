"""`python -m loadtests gpu-check --out DIR`: the engine on a GPU in one command.

For each model preset (random weights at the real shapes, drawn on the device, so
nothing downloads; worker/engine/model_presets.py):

1. greedy tokens equal transformers' for 3 prompts (fp32, our triton kernels);
2. which attention kernels a mixed step launched (profiler names);
3. decode ms/step at batch 1/32/64/128 x context 256/2,048 (bf16, CUDA graphs), each
   also as a roofline ratio = step time / ((weight bytes + KV bytes read) / bandwidth),
   and one point eager (no graph) for comparison;
4. prefill tokens/s; cached vs uncached time to first token for a 4k prefix; peak
   device memory.

Before that it runs `pytest -m gpu tests/gpu` when pytest is installed. Writes
gpu-check.json and gpu-check.md into DIR. `--quick --device cpu` runs the same path at
toy sizes (a CI test), with the triton kernels under TRITON_INTERPRET=1.
Imports no pydantic or redis (the GPU machine has neither).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

FULL = dict(presets=("qwen2.5-0.5b", "llama-3.2-1b"), batches=(1, 32, 64, 128),
            contexts=(256, 2048), steps=12, prefill=(4, 2048), prefix=4096, question=64,
            prompts=(7, 60, 300), new_tokens=16, eager_point=(64, 2048))  # fmt: skip
QUICK = dict(presets=("tiny",), batches=(1, 3), contexts=(16, 40), steps=2, prefill=(2, 32),
             prefix=64, question=8, prompts=(5, 12, 20), new_tokens=4,
             eager_point=(3, 40))  # fmt: skip
BUDGET_S = 450  # stop starting new measurements past this (the whole check: <= 8 min)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder for gpu-check.json/.md")
    p.add_argument("--device", default="cuda", help="(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--presets", help="comma-separated presets (default: the two real shapes)")
    p.add_argument("--attention-backend", default="auto", help="(default: %(default)s)")
    p.add_argument("--skip-pytest", action="store_true", help="do not run pytest -m gpu first")


def run_pytest(deadline: float) -> dict[str, Any]:
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "why": "pytest is not installed here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=max(30.0, deadline - time.monotonic()))  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ran": True, "passed": False, "tail": "timed out"}
    return {"ran": True, "passed": done.returncode == 0, "command": " ".join(cmd[1:]),
            "tail": (done.stdout + done.stderr)[-1500:]}  # fmt: skip


def check_preset(preset: str, device: torch.device, sizes: dict, backend: str, tmp: Path,
                 deadline: float) -> dict[str, Any]:  # fmt: skip
    from loadtests import gpu_bench as gb
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.runner import ModelRunner
    from worker.engine.tiny_model import PRESETS, make_tiny_model

    res: dict[str, Any] = {"preset": preset}
    t0 = time.monotonic()
    model_dir = make_tiny_model(tmp / preset, **PRESETS[preset], device=str(device),
                                dtype="bfloat16" if device.type == "cuda" else "float32")  # fmt: skip
    res["make_model_s"] = round(time.monotonic() - t0, 1)
    vocab = min(int(json.loads((model_dir / "config.json").read_text())["vocab_size"]), 1000)
    prompts = [[4 + (13 * i + 7 * n) % (vocab - 4) for i in range(n)] for n in sizes["prompts"]]
    try:
        res["greedy"] = gb.greedy_vs_transformers(
            model_dir, device, prompts, sizes["new_tokens"], backend
        )
    except Exception:  # recorded, and the measurements still run
        res["greedy"] = {"all_equal": False, "equal": "error", "error": traceback.format_exc()}
    batches, contexts, steps = sizes["batches"], sizes["contexts"], sizes["steps"]
    capacity = max(batches) * (max(contexts) + steps + 4)
    runner = ModelRunner(model_dir, device=str(device), kv_capacity_tokens=capacity,
                         attention_backend=backend, max_running_requests=max(batches))  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res["dtype"] = str(runner.dtype).removeprefix("torch.")
    res["attention_backend"] = runner.attention_backend
    try:
        res["kernels"] = gb.kernels_of_one_step(runner)
    except Exception as exc:  # e.g. no CUPTI for the profiler
        res["kernels"] = [f"profiler failed: {exc!r}"]
    bw = gb.bandwidth(device)
    res["bandwidth"] = bw
    weights, per_token = gb.weight_bytes(runner), gb.kv_bytes_per_token(runner)
    res["weight_bytes"], res["kv_bytes_per_token"] = weights, per_token
    res["decode"] = []
    for context in contexts:
        for batch in batches:
            if time.monotonic() > deadline:
                res["decode"].append({"batch": batch, "context": context, "skipped": "time budget"})
                continue
            ms = gb.decode_ms(runner, batch, context, steps)
            floor_ms = 1000 * (weights + batch * context * per_token) / bw["used_bytes_s"]
            res["decode"].append({"batch": batch, "context": context, "ms": round(ms, 3),
                                  "roofline_ms": round(floor_ms, 3),
                                  "roofline_ratio": round(ms / floor_ms, 2)})  # fmt: skip
    batch, context = sizes["eager_point"]
    graphs, runner.graphs = runner.graphs, None
    res["eager_point"] = {"batch": batch, "context": context,
                          "ms": round(gb.decode_ms(runner, batch, context, steps), 3)}  # fmt: skip
    runner.graphs = graphs
    res["graph_replays"] = graphs.replays if graphs else 0
    res["prefill_tokens_s"] = round(gb.prefill_tokens_s(runner, *sizes["prefill"]), 1)
    if device.type == "cuda":
        res["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(
        device=str(device), attention_backend=backend,
        kv_capacity_tokens=4 * (sizes["prefix"] + sizes["question"])))  # fmt: skip
    res["ttft"] = gb.ttft_cached_vs_uncached(engine, sizes["prefix"], sizes["question"], runs=3)
    res["ttft"]["prefix_tokens"] = sizes["prefix"]
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def to_markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"torch {report['torch']}, triton {report['triton']}, python {report['python']}; "
             f"`{report['command']}`; {report.get('seconds', 0):.0f} s.", ""]  # fmt: skip
    py = report["pytest"]
    lines += [f"pytest -m gpu: {'skipped (' + py['why'] + ')' if not py['ran'] else ('passed' if py['passed'] else 'FAILED')}", ""]  # fmt: skip
    for r in report["presets"]:
        if "error" in r:
            lines += [f"## {r['preset']}: FAILED", "", "```", r["error"][-3000:], "```", ""]
            continue
        bw = r["bandwidth"]
        g = r["greedy"]
        lines += [
            f"## {r['preset']} ({r['dtype']}, attention {r['attention_backend']})", "",
            f"- greedy equal to transformers (fp32, 3 prompts): {g['equal']}",
            f"- attention kernels in a mixed step: {', '.join(r['kernels']) or 'none seen'}",
            f"- bandwidth used for the roofline: {bw['used_bytes_s'] / 1e12:.2f} TB/s "
            f"({'spec' if bw['spec_bytes_s'] else 'measured copy'}; measured copy "
            f"{bw['measured_copy_bytes_s'] / 1e12:.2f} TB/s); weights {r['weight_bytes'] / 1e9:.2f} GB, "
            f"KV {r['kv_bytes_per_token'] / 1024:.1f} KiB/token",
            f"- prefill: {r['prefill_tokens_s']:,.0f} tokens/s; peak memory "
            f"{r.get('peak_memory_gib', 'n/a')} GiB; CUDA graph replays {r['graph_replays']}",
            f"- TTFT {r['ttft']['prefix_tokens']}-token prefix: uncached {r['ttft']['uncached_ms']:.1f} ms, "
            f"cached {r['ttft']['cached_ms']:.1f} ms (ratio {r['ttft']['ratio']:.3f}, "
            f"{r['ttft']['cached_tokens']} tokens hit)",
            f"- eager (no graph) at batch {r['eager_point']['batch']}, context "
            f"{r['eager_point']['context']}: {r['eager_point']['ms']} ms/step",
            "", "| batch | context | ms/step | roofline ms | ratio |", "|---|---|---|---|---|",
        ]  # fmt: skip
        for d in r["decode"]:
            if "skipped" in d:
                lines.append(f"| {d['batch']} | {d['context']} | skipped | | |")
            else:
                lines.append(f"| {d['batch']} | {d['context']} | {d['ms']} | {d['roofline_ms']} | {d['roofline_ratio']} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests gpu-check", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))


def main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + BUDGET_S
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "gpu-check: no CUDA device here (use --quick --device cpu to smoke-test)"
        )
    sizes = QUICK if args.quick else FULL
    presets = args.presets.split(",") if args.presets else sizes["presets"]
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "command": "python -m loadtests gpu-check " + " ".join(sys.argv[2:]),
    }  # fmt: skip
    report["pytest"] = ({"ran": False, "why": "--skip-pytest"} if args.skip_pytest
                        else run_pytest(start + 150))  # fmt: skip
    report["presets"] = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            try:
                result = check_preset(preset, device, sizes, args.attention_backend, Path(tmp),
                                      deadline)  # fmt: skip
            except Exception:  # one preset failing still leaves the other's numbers
                result = {"preset": preset, "error": traceback.format_exc()}
            report["presets"].append(result)
            # Written after each preset: a run cut short by a time limit keeps what it has.
            (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["seconds"] = time.monotonic() - start
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report)
    (args.out / "gpu-check.md").write_text(md)
    print(md)
    ok = all("error" not in r and r["greedy"]["all_equal"] for r in report["presets"])
    ok = ok and report["pytest"].get("passed", True)
    return 0 if ok else 1
