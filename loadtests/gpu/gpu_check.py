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
    ops          issue 25's pieces (loadtests/gpu/gpu_ops.py): the decode and extend kernels
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
"""

from __future__ import annotations

import argparse
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

from loadtests.gpu.gpu_report import to_markdown, write

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
        from loadtests.gpu.gpu_sections import run_section

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
        from loadtests.gpu.gpu_dry_run import check_report

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
            from loadtests.gpu.gpu_dry_run import stub_section

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
