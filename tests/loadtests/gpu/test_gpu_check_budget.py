"""gpu-check's driver as it runs on a GPU, here (issue 32): the CUDA-only branches (caps,
budget, section order, report writing) in a dry run with the device stubbed; the
default plan inside its budget; a CPU run under a 60 s budget that leaves every
section's rows or a `cut` mark.

The sections' device work is stubbed in the dry run (no GPU here): what is stubbed is
each section's process, never the driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
ORDER = ["env", "correctness", "preset:llama-3.2-1b", "ops", "host_tier", "preset:qwen2.5-0.5b",
         "pytest"]  # fmt: skip


def cuda_args(out: Path, **kw: object) -> Namespace:
    base = dict(out=out, device="cuda", quick=False, presets=None, attention_backend="auto",
                skip_pytest=False, sections=None, budget_s=420.0, dry_run=True, section=None)  # fmt: skip
    return Namespace(**(base | kw))


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CUDA 'available', and every section's process replaced by a recorder: a dry run
    must start none (on a driver without one, they stand in for the device)."""
    from loadtests.gpu import check

    started: list[str] = []

    def child(args: Namespace, name: str, state_dir: Path, allowed: float) -> dict:
        started.append(name)
        return {"seconds": 0.0}

    def pytest_section(args: Namespace, allowed: float) -> dict:
        started.append("pytest")
        return {"passed": True}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check, "run_child", child)
    monkeypatch.setattr(check, "run_pytest", pytest_section)
    return started


def test_a_dry_run_takes_every_cuda_branch_of_the_driver(
    tmp_path: Path, no_processes: list[str]
) -> None:
    """On main before issue 32 this raised KeyError: 'host_tier' (no cap for it, looked
    up on CUDA only), after env, correctness and ops had run."""
    from loadtests.gpu import check

    args = cuda_args(tmp_path / "out")
    assert check.main(args) == 0
    assert no_processes == []  # the dry run stubs the sections itself
    report = json.loads((args.out / "gpu-check.json").read_text())
    assert list(report["sections"]) == ORDER  # correctness and the headline preset first
    for name, section in report["sections"].items():
        assert section["allowed_s"] == check.cap_s(name)  # each under its own cap
    md = (args.out / "gpu-check.md").read_text()
    assert md.index("## llama-3.2-1b") < md.index("## Kernels") < md.index("## qwen2.5-0.5b")
    assert "DRY RUN" in md and "| fragmented ms/step |" in md and "ours / sdpa" in md


def test_the_default_plan_fits_its_budget_with_margin(tmp_path: Path) -> None:
    from loadtests.gpu import check

    names = check.plan(cuda_args(tmp_path))
    assert names == ORDER
    total = sum(check.cap_s(n) for n in names)
    assert total <= check.DEFAULT_BUDGET_S - check.MARGIN_S, total
    one = check.plan(cuda_args(tmp_path, sections="presets", presets="llama-3.2-1b"))
    assert one == ["preset:llama-3.2-1b"]


def test_a_missing_cap_fails_before_any_section_starts(
    tmp_path: Path, no_processes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from loadtests.gpu import check

    caps = {k: v for k, v in check.SECTION_CAP_S.items() if k != "host_tier"}
    monkeypatch.setattr(check, "SECTION_CAP_S", caps)
    with pytest.raises(KeyError, match="host_tier"):
        check.main(cuda_args(tmp_path / "out"))
    assert no_processes == [] and not (tmp_path / "out" / "gpu-check.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cpu_run_under_60_s_leaves_every_sections_rows_or_a_cut(tmp_path: Path) -> None:
    """`--device cpu --quick --budget-s 60`: every planned section is in the report,
    with the rows it finished or marked cut; the markdown shows both."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "loadtests", "gpu-check", "--out", str(out), "--device", "cpu",
           "--quick", "--attention-backend", "sdpa", "--budget-s", "60"]  # fmt: skip
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    report = json.loads((out / "gpu-check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["env", "correctness", "preset:tiny", "ops", "host_tier", "pytest"]
    md = (out / "gpu-check.md").read_text()
    finished_rows = 0
    for name, section in sections.items():
        steps = {k: v for k, v in section.items() if isinstance(v, (dict, list)) and k != "steps_s"}
        cut = "cut" in section or any(isinstance(v, dict) and "cut" in v for v in steps.values())
        ran = steps or (name == "pytest" and "passed" in section)  # pytest's row: its verdict
        assert ran or cut, (name, section)  # its rows, or marked cut
        finished_rows += sum(isinstance(v, (dict, list)) and "cut" not in v for v in steps.values())
        if cut:
            assert "CUT" in md
    assert finished_rows > 0 and "# GPU check" in md
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: something was cut
