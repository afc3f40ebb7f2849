"""`python -m loadtests gpu-check --out DIR`: the engine on a GPU in one command.

Sections, in this order (what answers "is it correct, and how fast is decode at the
headline cell" first; each in its own process: a CUDA error such as an illegal address
poisons the process that hit it, not the sections after it):

    env          device, versions, memory bandwidth (measured copy and spec)
    correctness  our kernels vs SDPA on the device (GQA 1/4/7, head dims 64/128, fp32
                 and bf16), host synchronisations per engine step (decode-only, mixed,
                 penalties + logprobs)
    preset:llama-3.2-1b
                 the headline preset (random weights at the real shapes, drawn on the
                 device, so nothing downloads): decode ms/step at batch 64 and 1 x
                 context 2,048 first, then greedy tokens equal to transformers' for 3
                 prompts (fp32), then batch 1/32/64/128 x context 256/2,048 (bf16, CUDA
                 graphs), each cell on contiguous and on fragmented slots, with roofline
                 ratios; the attention kernels a mixed step launched, prefill tokens/s,
                 cached vs uncached TTFT for a 4k prefix, one eager point, peak memory
    ops          issue 25's pieces (loadtests/gpu/ops.py): the decode and extend kernels
                 beside torch's SDPA over the same gathered pages (and vLLM's or
                 FlashInfer's kernels where importable) and the bandwidth floor; block
                 sizes; fused ops vs eager; sampler sort vs thresholds
    host_tier    the host KV tier: batched load bandwidth, no host sync, reload equality
    preset:qwen2.5-0.5b   the same as the first preset
    pytest       `pytest -m gpu tests/gpu`

DIR gets gpu-check.json and gpu-check.md, rewritten after every section and every
step of a section (every decode cell too), so a run cut short keeps what it measured;
a failing step is recorded with its traceback and the rest go on. `--budget-s` bounds
the whole run and each section has a cap (SECTION_CAP_S; they add up to the default
budget less MARGIN_S): a section, step or cell that would start past its deadline is
recorded as `cut`, and a section killed at its cap is marked `cut` too. `--dry-run`
runs this driver as on the device (caps, budget, order, report writing) with every
section stubbed by sample rows: no device, no process (a CI test). `--quick --device
cpu` runs every section at toy sizes (a CI test; the triton kernels then run under
TRITON_INTERPRET=1). Imports only the standard library, torch, triton, numpy,
transformers, tokenizers and safetensors (what the GPU machine has).

The dry run (issue 32): the first GPU run crashed in the driver, not on the device: a section with no time cap
raised KeyError on CUDA only, after three sections had spent the loan. A dry run takes
every branch the driver takes on `--device cuda` (the caps, the budget, the order, the
report's JSON and markdown after every section) with each section's process replaced
by `stub_section`, which returns rows shaped as a GPU run writes them, CUDA-only keys
included (device name and capability, peak memory, profiled kernel names). Nothing is
started and no device is touched; the markdown is built strictly (`check_report`), so
a key the writer expects and a section lacks fails here instead of being swallowed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.gpu.report import to_markdown, write

# The first preset runs right after correctness (the headline decode cell), the others
# after host_tier.
PRESETS = ("llama-3.2-1b", "qwen2.5-0.5b")
DEFAULT_BUDGET_S = 420.0  # what fits one 15-minute loan beside a machine start and a rerun
# The most seconds each section may take (also cut by what is left of --budget-s); a
# preset not named here gets "preset". The default plan's caps add up to
# DEFAULT_BUDGET_S - MARGIN_S (a test holds it): process starts and the report's
# writing between sections fit in the margin. Estimates: loadtests/results/gpu.md.
SECTION_CAP_S = {"env": 20, "correctness": 45, "preset:llama-3.2-1b": 130, "ops": 55,
                 "host_tier": 30, "preset:qwen2.5-0.5b": 60, "preset": 60, "pytest": 40}  # fmt: skip
MARGIN_S = 40
MIN_START_S = 25  # a section is not started with less than this left
CHILD_GRACE_S = 15  # a section stops starting steps this long before it is killed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder for gpu-check.json/.md")
    p.add_argument("--device", default="cuda", help="(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--presets", help=f"comma-separated (default: {','.join(PRESETS)})")
    p.add_argument("--attention-backend", default="auto", help="(default: %(default)s)")
    p.add_argument("--skip-pytest", action="store_true", help="leave out the pytest section")
    p.add_argument("--sections",
                   help="comma-separated subset of env,correctness,ops,host_tier,presets,pytest")  # fmt: skip
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the driver as on the device with every section stubbed (no device)",
    )
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall-clock seconds for the whole run; what would start later is "
                        "recorded as cut (default: %(default)s)")  # fmt: skip
    # Internal: one section in this process (the parent starts these).
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests gpu-check", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))


def main(args: argparse.Namespace) -> int:
    if args.section:
        from loadtests.gpu.sections import run_section

        return run_section(args)
    import torch  # only to say early that there is no GPU

    if args.dry_run:
        return orchestrate(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            "gpu-check: no CUDA device here (use --quick --device cpu to smoke-test)"
        )
    return orchestrate(args)


def plan(args: argparse.Namespace) -> list[str]:
    """The sections to run, in order. Every one has a cap (KeyError here, before any
    section starts, if one lacks it)."""
    presets = args.presets.split(",") if args.presets else (["tiny"] if args.quick else PRESETS)
    wanted = set(args.sections.split(",")) if args.sections else None
    order = ("env", "correctness", "first_preset", "ops", "host_tier", "presets", "pytest")
    names = []
    for name in order:
        group = "presets" if name.endswith("preset") else name
        if wanted is not None and group not in wanted:
            continue
        if name == "pytest" and args.skip_pytest:
            continue
        if name == "first_preset":
            names.append(f"preset:{presets[0]}")
        elif name == "presets":
            names += [f"preset:{p}" for p in presets[1:]]
        else:
            names.append(name)
    for name in names:
        cap_s(name)
    return names


def cap_s(name: str) -> float:
    """The section's cap; KeyError naming it when SECTION_CAP_S has none."""
    if name in SECTION_CAP_S:
        return SECTION_CAP_S[name]
    kind = name.split(":")[0]
    if kind not in SECTION_CAP_S:
        raise KeyError(f"gpu-check: no time cap for section {name!r} in SECTION_CAP_S")
    return SECTION_CAP_S[kind]


def orchestrate(args: argparse.Namespace) -> int:
    start = time.time()
    deadline = start + args.budget_s
    # Nothing is downloaded: the models are made here (the sections inherit this).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": "python -m loadtests gpu-check " + " ".join(sys.argv[2:]),
        "python": platform.python_version(), "budget_s": args.budget_s,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)),
        "sections": {},
    }  # fmt: skip
    state_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    # An outer `timeout` (SIGTERM to the process group) still leaves the report, with
    # the section it cut short as far as that got.
    previous = signal.signal(signal.SIGTERM, _stop)
    names = plan(args)
    if args.dry_run:
        report["dry_run"] = "every section stubbed with sample rows; nothing ran on a device"
    write(args.out, report)
    try:
        for name in names:
            left = deadline - time.time()
            if left < MIN_START_S:
                report["sections"][name] = {"cut": f"not started, {left:.0f} s of the budget left"}
            else:
                report["sections"][name] = run_section(args, name, state_dir, left)
            if args.dry_run:
                check_report(report)  # a KeyError in the markdown fails here, not silently
            report["seconds"] = round(time.time() - start, 1)
            write(args.out, report)
    except Stopped as stop:
        if len(stop.args) == 2:
            report["sections"][stop.args[0]] = stop.args[1]
        report["seconds"] = round(time.time() - start, 1)
        write(args.out, report)
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(to_markdown(report), flush=True)
    return 0 if passed(report) else 1


def run_section(args: argparse.Namespace, name: str, state_dir: Path, left: float) -> dict:
    kind = name.split(":")[0]
    # The caps are sized for a GPU; on CPU (toy sizes, the interpreter) only the budget.
    allowed = min(cap_s(name), left) if args.device.startswith("cuda") else left
    print(f"\n=== gpu-check: {name} (up to {allowed:.0f} s) ===", flush=True)
    try:
        if args.dry_run:
            return stub_section(name, allowed)
        if kind == "pytest":
            return run_pytest(args, allowed)
        return run_child(args, name, state_dir, allowed)
    except Stopped:
        state = state_dir / (name.replace(":", "-") + ".json")
        result = json.loads(state.read_text()) if state.exists() else {}
        result["process_error"] = "stopped by SIGTERM (an outer timeout?) in this section"
        raise Stopped(name, result) from None


class Stopped(Exception):
    """SIGTERM arrived (`timeout` sends it to the whole process group)."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped


def run_child(args: argparse.Namespace, name: str, state_dir: Path, allowed: float) -> dict:
    """One section in a child process; what it recorded survives its crash or kill."""
    state = state_dir / (name.replace(":", "-") + ".json")
    cmd = [sys.executable, "-X", "faulthandler", "-m", "loadtests", "gpu-check",
           "--out", str(args.out), "--device", args.device, "--section", name,
           "--state", str(state), "--deadline", str(time.time() + allowed - CHILD_GRACE_S),
           "--attention-backend", args.attention_backend] + (["--quick"] if args.quick else [])  # fmt: skip
    t0 = time.time()
    try:
        code = subprocess.run(cmd, timeout=allowed, check=False).returncode
        why = None if code == 0 else f"the section's process exited with code {code} (see the log)"
    except subprocess.TimeoutExpired:
        why = f"the section's process was killed at its {allowed:.0f} s limit"
    result = json.loads(state.read_text()) if state.exists() else {}
    result["seconds"] = round(time.time() - t0, 1)
    if why:
        result["process_error"] = why
        if "killed" in why:
            result["cut"] = (
                f"killed at its {allowed:.0f} s limit; the rows above are what it finished"
            )
    return result


def run_pytest(args: argparse.Namespace, allowed: float) -> dict:
    """`pytest -m gpu tests/gpu`, with only tests/gpu's conftest: the repository's
    top-level conftest imports redis, which the GPU machine does not have."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "--confcutdir", "tests/gpu", "tests/gpu"]  # fmt: skip
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"skipped": "pytest is not installed here"}
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=allowed, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return {"passed": False, "command": " ".join(cmd[1:]), "tail": out[-3000:] + "\ntimed out",
                "cut": f"killed at its {allowed:.0f} s limit"}  # fmt: skip
    print(done.stdout[-6000:] + done.stderr[-3000:], flush=True)
    tail = (done.stdout + done.stderr)[-3000:]
    # Exit code 5: nothing collected or all deselected; every test skipped still exits 0.
    return {"passed": done.returncode == 0, "exit_code": done.returncode,
            "command": " ".join(cmd[1:]), "tail": tail}  # fmt: skip


def passed(report: dict[str, Any]) -> bool:
    """Every section ran whole (nothing failed, nothing skipped) and its checks held."""
    for result in report["sections"].values():
        if {"process_error", "skipped", "cut", "unfinished", "fallback"} & result.keys():
            return False
        if result.get("passed") is False:
            return False
        for value in result.values():
            for part in value if isinstance(value, list) else [value]:
                if isinstance(part, dict) and ({"error", "skipped", "cut"} & part.keys()
                                               or part.get("passed") is False
                                               or part.get("all_equal") is False):  # fmt: skip
                    return False
    return True


# fmt: off
_BW = {"device": "NVIDIA H100 80GB HBM3", "spec_bytes_s": 3.35e12,
       "measured_copy_bytes_s": 3.0e12, "used_bytes_s": 3.35e12}
_CELL = {"ms": 3.2, "roofline_ms": 1.4, "roofline_ratio": 2.29, "measured_floor_ms": 1.56,
         "measured_ratio": 2.05, "fragmented_ms": 3.5, "fragmented_ratio": 2.5,
         "fragmented_over_contiguous": 1.09}
_BASELINE_ROW = {"items": 64, "new": 1, "tokens": 2048, "ours_us": 100.0, "floor_us": 45.0,
                 "ours_over_floor": 2.22, "rel_diff_vs_sdpa": 4e-3, "passed": True,
                 "baselines": {"sdpa": {"us": 90.0, "ours_over_it": 1.11},
                               "sdpa+gather": {"us": 300.0, "ours_over_it": 0.33},
                               "flashinfer": {"skipped": "not importable on this machine"},
                               "vllm": {"skipped": "not importable on this machine"}},
                 "sdpa_kernels": {"flash_attention": {"us": 90.0, "ours_over_it": 1.11},
                                  "efficient_attention": {"skipped": "No available kernel"},
                                  "cudnn_attention": {"us": 95.0, "ours_over_it": 1.05},
                                  "math": {"us": 900.0, "ours_over_it": 0.11}}}
SAMPLES: dict[str, dict[str, Any]] = {
    "env": {"versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0",
                         "torch_cuda": "13.0"},
            "device": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                       "memory_gib": 79.2, "multiprocessors": 132},
            "bandwidth": _BW},
    "correctness": {
        "kernels": {"cases": [{"dtype": "bfloat16", "max_abs_diff": 4e-3, "ok": True}],
                    "passed": True},
        "syncs": {"per_step": {"decode": 1, "mixed": 1}, "how": "CUDA sync debug mode",
                  "unexpected": [], "passed": True},
    },
    "ops": {
        "bandwidth": _BW,
        "decode": {"batch": 64, "context": 2048, "dtype": "bfloat16", "fp8_vs": "bf16",
                   "fp8_speedup": 1.6,
                   "bf16": {"us_per_layer": 100.0, "floor_us": 45.0, "ratio": 2.22,
                            "kv_bytes": 1 << 27, "rel_diff_vs_sdpa": 4e-3, "passed": True},
                   "fp8_e4m3": {"us_per_layer": 62.0, "floor_us": 22.5, "ratio": 2.76,
                                "kv_bytes": 1 << 26, "rel_diff_vs_sdpa": 2e-2, "passed": True}},
        "baseline": {"dtype": "bfloat16", "passed": True,
                     "rows": [_BASELINE_ROW | {"kind": "decode"},
                              _BASELINE_ROW | {"kind": "extend", "items": 4, "new": 512,
                                               "tokens": 1536}]},
        "table": {"fastest_row": {"head_dim": 64, "element_size": 2, "decode_block_n": 64}},
        "fused": {"tokens": 64, "dtype": "bfloat16",
                  "add_rmsnorm": {"eager_us": 30.0, "fused_us": 10.0, "speedup": 3.0,
                                  "rel_diff": 1e-3, "passed": True}},
        "sampler": {"batch": 64, "vocab": 128256, "sort_ms": 2.0, "threshold_ms": 0.5,
                    "speedup": 4.0, "rows_whose_kept_set_differs": 0, "rows_off_fp64_sort": 0,
                    "rows_off_fp64_threshold": 0, "passed": True},
    },
    "host_tier": {
        "load_bandwidth": {"tokens": 16384, "page": 16, "bytes": 2 << 30, "load_bytes_s": 2e10,
                           "write_back_bytes_s": 2e10, "plain_h2d_bytes_s": 2.5e10,
                           "load_over_plain": 0.8, "passed": True,
                           "pinning": "registered", "host_bytes": 8 << 30,
                           "host_bytes_if_pin_memory": 8 << 30},
        "no_host_sync": {"how": "CUDA sync debug mode", "passed": True},
        "greedy_equal": {"passed": True, "cached_tokens": 48, "prefix": 48, "host_loaded": 48},
    },
    "preset": {
        "model": "/tmp/model",
        "runner": {"dtype": "bfloat16", "attention_backend": "triton", "weight_bytes": 2_471_000_000,
                   "kv_bytes_per_token": 32768, "bandwidth": _BW},
        "startup_capture": {"seconds": 4.0, "captures": 20},
        "decode": [{"batch": 64, "context": 2048} | _CELL, {"batch": 1, "context": 2048} | _CELL],
        "kernels": ["_decode_split_kernel", "_extend_kernel"],
        "no_capture_in_traffic": {"late_captures": 0, "replays": 40, "passed": True},
        "eager_point": {"batch": 64, "context": 2048, "ms": 9.0},
        "piecewise_mixed": {"decodes": 32, "context": 1024, "chunk": 512, "tokens": 544,
                            "graphs": "cuda", "piecewise_ms": 8.0, "eager_ms": 11.0,
                            "speedup": 1.38, "capture_s": 1.2, "late_captures": 0,
                            "max_abs_diff": 0.01, "passed": True},
        "overlap_decode": {"batch": 64, "context": 2048, "overlap_ms": 4.0, "in_order_ms": 4.6,
                           "speedup": 1.15, "greedy_equal": True},
        "graph_replays": 300,
        "prefill_tokens_s": 40000.0,
        "ttft": {"uncached_ms": 120.0, "cached_ms": 9.0, "ratio": 0.075, "cached_tokens": 4096,
                 "prefix_tokens": 4096},
        "peak_memory_gib": 12.5,
        "greedy": {"equal": [True, True, True], "all_equal": True, "first_difference": [None] * 3,
                   "graph_replays": 40},
    },
    "pytest": {"passed": True, "exit_code": 0, "command": "pytest -q -m gpu tests/gpu",
               "tail": "8 passed"},
}
# fmt: on


def stub_section(name: str, allowed: float) -> dict[str, Any]:
    """What section `name` would write on a GPU, with the seconds it was allowed."""
    kind = name.split(":")[0]
    if kind not in SAMPLES:
        raise KeyError(f"gpu-check --dry-run: no sample rows for section {name!r}")
    return copy.deepcopy(SAMPLES[kind]) | {"seconds": 0.0, "allowed_s": round(allowed, 1)}


def check_report(report: dict[str, Any]) -> str:
    """The markdown, built without the writer's safety net (errors propagate)."""
    return to_markdown(report)
