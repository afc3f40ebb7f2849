"""The report of one load-test run, from its per-request records: the result file and plots.

`summarize(records, slo, workers)` (loadtests/load/summary.py) gives the numbers: vLLM's
serving metrics (TTFT, TPOT, ITL, E2E latency, throughput, goodput) for the run and per
worker, and the figures only a cache-aware fleet has (hit rate from `cached_tokens`,
requests per worker over every worker of the fleet, idle ones included).
`write_report(records, out_dir)` also writes `summary.json`, the result file, under
`vllm bench serve`'s field names where the meaning is the same (`completed`,
`request_throughput`, `p99_ttft_ms`, ...), and three PNGs a person would rather look at
than read: `ttft.png` (distribution), `latency_over_time.png`, `hit_rate_per_worker.png`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: works headless and in CI
import matplotlib.pyplot as plt
import numpy as np

from loadtests.load.metrics import RequestRecord
from loadtests.load.serving import SLO
from loadtests.load.summary import Summary, summarize

__all__ = ["Summary", "summarize", "write_report"]


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", type=Path, help="a records.jsonl written by a run")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the plots (default: the records' folder)"
    )
    p.add_argument("--slo", default="", help="goodput objectives in ms, e.g. ttft=500,tpot=50")


def main(args: argparse.Namespace) -> int:
    from loadtests.load.metrics import read_records

    records = read_records(args.records)
    summary = write_report(records, args.out or Path(args.records).parent, slo=SLO.parse(args.slo))
    print(summary.table())
    print(summary.worker_table())
    return 0
