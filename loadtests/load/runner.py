"""Run locust headless against one OpenAI-compatible URL and report the run.

    python -m loadtests run --host http://127.0.0.1:8000 --workload shared_prefix \\
        --groups 8 --prompts-per-group 8 --system-len 512 --users 16 --out loadtests/out/run1

Writes into `--out`: locust's CSVs (`locust_stats.csv`, ...) and HTML report
(`locust.html`), `records.jsonl` (one line per request), `summary.json` (the result
file, under `vllm bench serve`'s field names), and the PNGs of `loadtests.load.runner`.
Every worker of the fleet is in the report: the router's GET /workers lists them before
the run, so a worker that received nothing shows 0 requests and counts in the spread
(against a worker directly, or a server without /workers, the records name them).
`--slo ttft=MS,tpot=MS` adds goodput; `--request-rate R` sends open loop (Poisson,
R req/s, at most `--users` in flight). Without `--run-time` the run ends when the workload does; with
one, the workload starts over until the time is up. A progress line every few seconds
(requests done, failures, time left), and a one-line verdict at the end that names the
commonest error if requests failed.

The report of a run (`write_report`, and `python -m loadtests report` again later) comes
from its per-request records: `summarize(records, slo, workers)` (loadtests/load/summary.py)
gives the numbers; `summary.json` is the result file, under `vllm bench serve`'s field
names where the meaning is the same (`completed`, `request_throughput`, `p99_ttft_ms`,
...); three PNGs a person would rather look at than read: `ttft.png` (distribution),
`latency_over_time.png`, `hit_rate_per_worker.png`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

from loadtests.kit import (
    Command,
    Progress,
    WorkloadOptions,
    add_workload_arguments,
    clock_text,
    options_from_namespace,
    options_to_argv,
)
from loadtests.load.records import RequestRecord, read_records
from loadtests.load.summary import SLO
from shared.procs import http_json

matplotlib.use("Agg")  # files only, no display: works headless and in CI
import matplotlib.pyplot as plt
import numpy as np

from loadtests.load.summary import Summary, summarize


def plot_ttft(records: list[RequestRecord], path: Path, title: str = "") -> None:
    ttft = np.array([r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    if len(ttft):
        ax1.hist(ttft, bins=40, color="#4878d0")
        xs = np.sort(ttft)
        ax2.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color="#4878d0")
        for q in (50, 99):
            ax2.axvline(np.percentile(ttft, q), ls="--", lw=0.8, color="gray")
            ax2.text(np.percentile(ttft, q), 0.05, f" p{q}", color="gray", fontsize=8)
    ax1.set(xlabel="time to first token (ms)", ylabel="requests", title="TTFT histogram")
    ax2.set(xlabel="time to first token (ms)", ylabel="fraction ≤ x", title="TTFT CDF")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_latency_over_time(records: list[RequestRecord], path: Path, title: str = "") -> None:
    ok = sorted((r for r in records if r.ok), key=lambda r: r.start)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if ok:
        t0 = ok[0].start
        t = np.array([r.start - t0 for r in ok])
        e2e = np.array([r.e2e_s * 1000 for r in ok])
        ttft = np.array([(r.ttft_s or 0) * 1000 for r in ok])
        ax.scatter(t, e2e, s=4, alpha=0.4, label="end to end", color="#ee854a")
        ax.scatter(t, ttft, s=4, alpha=0.4, label="TTFT", color="#4878d0")
        window = max(1, len(ok) // 30)  # a rolling median smooths the scatter into a trend
        if len(ok) > window:
            med = [np.median(ttft[max(0, i - window) : i + 1]) for i in range(len(ok))]
            ax.plot(t, med, color="#1f3f8f", lw=1.2, label=f"TTFT rolling median ({window})")
        failed = [r.start - t0 for r in records if not r.ok]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
        ax.legend(loc="upper left", fontsize=8)
    ax.set(xlabel="seconds since start", ylabel="latency (ms)", title=title or "latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_hit_rate_per_worker(summary: Summary, path: Path, title: str = "") -> None:
    workers = list(summary.per_worker_requests)
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(workers) + 3), 3.6))
    x = np.arange(len(workers))
    ax.bar(x - 0.2, [summary.per_worker_hit_rate[w] for w in workers], 0.4, label="hit rate")
    ax.set(ylim=(0, 1), ylabel="cached / prompt tokens", xticks=x)
    ax.set_xticklabels(workers, rotation=30, ha="right", fontsize=8)
    ax2 = ax.twinx()
    ax2.bar(
        x + 0.2,
        [summary.per_worker_requests[w] for w in workers],
        0.4,
        color="#ee854a",
        label="requests",
    )
    ax2.set(ylabel="requests")
    ax.axhline(summary.hit_rate, ls="--", lw=0.8, color="gray")
    ax.set_title(title or f"hit rate per worker (overall {summary.hit_rate:.3f})")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(
    records: list[RequestRecord],
    out_dir: str | Path,
    title: str = "",
    slo: SLO | None = None,
    workers: Iterable[str] = (),
    run_info: dict[str, object] | None = None,
) -> Summary:
    """`run_info`: how the load was offered, under vLLM's names (request_rate,
    burstiness, max_concurrency), written into summary.json with the metrics."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, slo, workers)
    result = {**summary.to_dict(), **(run_info or {})}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_ttft(records, out / "ttft.png", title)
    plot_latency_over_time(records, out / "latency_over_time.png", title)
    plot_hit_rate_per_worker(summary, out / "hit_rate_per_worker.png", title)
    return summary


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", type=Path, help="a records.jsonl written by a run")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the plots (default: the records' folder)"
    )
    p.add_argument("--slo", default="", help="goodput objectives in ms, e.g. ttft=500,tpot=50")


def report_main(args: argparse.Namespace) -> int:
    records = read_records(args.records)
    summary = write_report(records, args.out or Path(args.records).parent, slo=SLO.parse(args.slo))
    print(summary.table())
    print(summary.worker_table())
    return 0


LOCUSTFILE = Path(__file__).with_name("locustfile.py")
PROGRESS_EVERY_S = 5.0


def seconds_of(run_time: str) -> float:
    """Locust's --run-time ("90", "20s", "1m30s", "1h") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s?)?", run_time.strip())
    if not parts or not any(parts.groups()):
        raise ValueError(f"--run-time: {run_time!r} is not like 90, 20s, 1m30s or 1h")
    h, m, s = (int(x or 0) for x in parts.groups())
    return 3600 * h + 60 * m + s


def verdict(summary: Summary, records: list[RequestRecord]) -> str:
    """One line: what the run did, or why it failed."""
    if summary.requests == 0:
        return "verdict: FAILED, no request finished"
    if summary.failures:
        errors = Counter(r.error or "unknown" for r in records if not r.ok)
        error, count = errors.most_common(1)[0]
        return (
            f"verdict: FAILED, {summary.failures} of {summary.requests} requests failed; "
            f"commonest error ({count}x): {error[:300]}"
        )
    good = summary.serving.request_goodput
    goodput = "" if good is None else f", goodput {good:.1f} req/s"
    balance = summary.balance()  # an uneven spread says why (loadtests/load/summary.py)
    return (
        f"verdict: OK, {summary.requests} requests, {summary.throughput_rps:.1f} req/s{goodput}, "
        f"TTFT p50 {summary.ttft_p50_ms:.0f} ms, hit rate {summary.hit_rate:.2f}"
        + (f"; {balance}" if balance else "")
    )


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))
    except OSError:
        return 0


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
    request_rate: float = 0.0  # req/s, open loop (Poisson); 0: closed loop, `users` at once
    slo: SLO | None = None
    api_key: str = ""


def fleet_workers(host: str, api_key: str = "") -> list[str] | None:
    """The worker ids a router knows (GET /workers), or None where `host` has no such
    list (a worker, another server): then the records are all there is."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, body = http_json(host.rstrip("/") + "/workers", headers=headers, timeout=5.0)
    except (OSError, ValueError):
        return None
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    return sorted(str(w["worker_id"]) for w in body["data"] if "worker_id" in w)


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
    if spec.request_rate:
        cmd += ["--request-rate", str(spec.request_rate)]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    if not spec.stream:
        cmd.append("--no-stream")
    return cmd + options_to_argv(workload)


def run(spec: RunSpec, workload: WorkloadOptions, title: str = "", quiet: bool = False) -> Summary:
    """Run locust to completion, then write and return the report. Raises on a locust crash."""
    spec.out.mkdir(parents=True, exist_ok=True)
    records_path = spec.out / "records.jsonl"
    records_path.unlink(missing_ok=True)  # the locustfile appends
    log_path = spec.out / "locust.log"
    total = seconds_of(spec.run_time) if spec.run_time else None
    progress = Progress("run", 1)
    workers = fleet_workers(spec.host, spec.api_key)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            locust_command(spec, workload), stdout=log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        try:
            while True:
                try:
                    proc.wait(PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if progress.elapsed > spec.timeout_s:
                    raise RuntimeError(f"locust still running after {spec.timeout_s:.0f}s")
                if not quiet:
                    done = _lines(records_path)
                    left = None if total is None else max(0.0, total - progress.elapsed)
                    progress.say(f"{done} requests finished", left=left)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or not records_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"locust exited with {proc.returncode}; log {log_path}:\n{tail}")
    records = read_records(records_path)
    # vLLM's traffic fields: "inf" rate when every user sends as soon as it can.
    run_info = {
        "request_rate": spec.request_rate or "inf", "burstiness": 1.0,
        "max_concurrency": spec.users, "workers_from": "GET /workers" if workers else "records",
    }  # fmt: skip
    summary = write_report(
        records, spec.out, title or workload.workload, spec.slo, workers or (), run_info
    )
    if not quiet:
        print(summary.table())
        print(summary.worker_table())
        if workers is None:
            print("(workers as the records name them: the host has no GET /workers)")
        print(f"report: {spec.out} (locust's log: {log_path})")
        print(f"{verdict(summary, records)} ({clock_text(progress.elapsed)})")
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--host", required=True, help="base URL of the router or a worker")
    p.add_argument("--out", type=Path, default=Path("loadtests/out/run"), help=f"report folder {d}")
    p.add_argument("--users", type=int, default=16, help=f"concurrent simulated users {d}")
    p.add_argument(
        "--spawn-rate",
        type=float,
        default=0.0,
        help="users started per second (default: all at once)",
    )
    p.add_argument(
        "--run-time", default=None,
        help="wall time, e.g. 60s or 2m; the workload repeats until it is up "
        "(default: one pass over the workload)",
    )  # fmt: skip
    p.add_argument(
        "--max-requests",
        type=int,
        default=0,
        help="stop after this many requests (default: 0, no cap)",
    )
    p.add_argument(
        "--model", default="", help="model name to send (default: none; the server picks)"
    )
    p.add_argument(
        "--no-stream", action="store_true", help="ask for whole answers, not SSE streams"
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, help=f"hard stop for locust, in seconds {d}"
    )
    p.add_argument(
        "--request-rate", type=float, default=0.0,
        help="open loop: Poisson arrivals, requests/s, at most --users in flight "
        "(default: 0, closed loop: each user sends when its last request ends)",
    )  # fmt: skip
    p.add_argument(
        "--slo", default="",
        help="goodput objectives per request, ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2el)",
    )  # fmt: skip
    p.add_argument("--api-key", default="", help="bearer token for the router (and /workers)")
    add_workload_arguments(p)


def main(args: argparse.Namespace) -> int:
    spec = RunSpec(
        host=args.host, out=args.out, users=args.users, spawn_rate=args.spawn_rate,
        run_time=args.run_time, max_requests=args.max_requests, model=args.model,
        stream=not args.no_stream, timeout_s=args.timeout, request_rate=args.request_rate,
        slo=SLO.parse(args.slo), api_key=args.api_key,
    )  # fmt: skip
    summary = run(spec, options_from_namespace(args))
    return 1 if summary.failures else 0


REPORT = Command(
    "The summary and plots of a run again, from its records.jsonl (see `run`).",
    report_arguments,
    report_main,
)
