"""`python -m loadtests gpu-check`: its whole path at toy sizes on CPU, in a process
where pydantic and redis cannot be imported (the GPU machine has neither)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]

# Blocks the modules the GPU machine lacks, then runs the command as `python -m` would.
RUNNER = """
import sys
for name in ("pydantic", "redis"):
    sys.modules[name] = None
from loadtests.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_quick_gpu_check_runs_on_cpu_without_pydantic_or_redis(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    env = os.environ | {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", RUNNER, "gpu-check", "--out", str(out), "--device", "cpu",
           "--quick", "--attention-backend", "triton", "--skip-pytest"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    (preset,) = report["presets"]
    assert preset["preset"] == "tiny" and preset["attention_backend"] == "triton"
    assert preset["greedy"]["all_equal"] and len(preset["greedy"]["equal"]) == 3
    cells = {(d["batch"], d["context"]) for d in preset["decode"]}
    assert cells == {(1, 16), (3, 16), (1, 40), (3, 40)}
    assert all(d["ms"] > 0 and d["roofline_ratio"] > 0 for d in preset["decode"])
    assert preset["ttft"]["cached_tokens"] >= 64
    assert preset["prefill_tokens_s"] > 0 and preset["eager_point"]["ms"] > 0
    md = (out / "gpu-check.md").read_text()
    assert "| batch | context | ms/step | roofline ms | ratio |" in md


def test_gpu_check_without_cuda_says_so(tmp_path: Path) -> None:
    import torch

    from loadtests import gpu_check

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        gpu_check.cli(["--out", str(tmp_path)])
