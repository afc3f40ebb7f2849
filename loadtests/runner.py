"""Run locust headless against one OpenAI-compatible URL and report the run.

    python -m loadtests run --host http://127.0.0.1:8000 --workload shared_prefix \\
        --groups 8 --prompts-per-group 8 --system-len 512 --users 16 --out loadtests/out/run1

Writes into `--out`: locust's CSVs (`locust_stats.csv`, ...) and HTML report
(`locust.html`), `records.jsonl` (one line per request), `summary.json`, and the PNGs
of `loadtests.report`. Without `--run-time` the run ends when the workload does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtests.metrics import HitCounter, read_records
from loadtests.options import (
    WorkloadOptions,
    add_workload_arguments,
    options_from_namespace,
    options_to_argv,
)
from loadtests.report import Summary, write_report

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class RunSpec:
    host: str
    out: Path
    users: int = 16
    spawn_rate: float = 0.0  # 0: all users at once
    run_time: str | None = None  # locust's -t (e.g. "60s"); None: until the workload ends
    max_requests: int = 0
    model: str = ""
    stream: bool = True
    timeout_s: float = 3600.0  # hard stop for the locust process


def locust_command(spec: RunSpec, workload: WorkloadOptions) -> list[str]:
    rate = spec.spawn_rate or spec.users
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(spec.users), "-r", str(rate), "--host", spec.host,
        "--csv", str(spec.out / "locust"), "--html", str(spec.out / "locust.html"),
        "--records-file", str(spec.out / "records.jsonl"), "--only-summary",
        "--stop-timeout", "30", "--exit-code-on-error", "0",
    ]  # fmt: skip
    if spec.run_time:
        cmd += ["-t", spec.run_time]
    if spec.max_requests:
        cmd += ["--max-requests", str(spec.max_requests)]
    if spec.model:
        cmd += ["--model", spec.model]
    if not spec.stream:
        cmd.append("--no-stream")
    return cmd + options_to_argv(workload)


def run(spec: RunSpec, workload: WorkloadOptions, title: str = "", quiet: bool = False) -> Summary:
    """Run locust to completion, then write and return the report. Raises on a locust crash."""
    spec.out.mkdir(parents=True, exist_ok=True)
    records_path = spec.out / "records.jsonl"
    records_path.unlink(missing_ok=True)  # the locustfile appends
    log_path = spec.out / "locust.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(
            locust_command(spec, workload), stdout=log, stderr=subprocess.STDOUT,
            timeout=spec.timeout_s, check=False, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
    if proc.returncode != 0 or not records_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"locust exited with {proc.returncode}; log {log_path}:\n{tail}")
    records = read_records(records_path)
    summary = write_report(records, spec.out, title or workload.workload)
    if not quiet:
        print(summary.table())
        print(HitCounter.from_records(records).table())
        print(f"report: {spec.out}")
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", required=True, help="base URL of the router or a worker")
    p.add_argument("--out", type=Path, default=Path("loadtests/out/run"))
    p.add_argument("--users", type=int, default=16, help="concurrent simulated users")
    p.add_argument("--spawn-rate", type=float, default=0.0, help="users started per second")
    p.add_argument("--run-time", default=None, help="e.g. 60s; default: until the workload ends")
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--model", default="")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    add_workload_arguments(p)


def main(args: argparse.Namespace) -> int:
    spec = RunSpec(
        host=args.host, out=args.out, users=args.users, spawn_rate=args.spawn_rate,
        run_time=args.run_time, max_requests=args.max_requests, model=args.model,
        stream=not args.no_stream, timeout_s=args.timeout,
    )  # fmt: skip
    summary = run(spec, options_from_namespace(args))
    return 1 if summary.failures else 0
