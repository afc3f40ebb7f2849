"""Summary and plots of one load-test run, computed from its per-request records.

`summarize(records)` gives the numbers (throughput, TTFT / latency percentiles, cache
hit rate, requests per worker); `write_report(records, out_dir)` also writes
`summary.json` and three PNGs a person would rather look at than read:
`ttft.png` (distribution), `latency_over_time.png`, `hit_rate_per_worker.png`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: works headless and in CI
import matplotlib.pyplot as plt
import numpy as np

from loadtests.metrics import HitCounter, RequestRecord


@dataclass(frozen=True)
class Summary:
    requests: int
    failures: int
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    itl_p50_ms: float
    hit_rate: float
    per_worker_requests: dict[str, int]
    per_worker_hit_rate: dict[str, float]

    @property
    def load_max_over_mean(self) -> float:
        """Max / mean requests per worker: 1.0 is a perfectly even spread."""
        counts = list(self.per_worker_requests.values())
        return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else 0.0

    def over_fleet(self, worker_ids: Iterable[str]) -> Summary:
        """The same run, with the fleet's idle workers counted (0 requests): a policy
        that sends everything to one of 4 workers spreads max/mean 4.0, not 1.0."""
        ids = list(worker_ids)
        counts = dict.fromkeys(ids, 0) | self.per_worker_requests
        rates = dict.fromkeys(ids, 0.0) | self.per_worker_hit_rate
        return replace(self, per_worker_requests=counts, per_worker_hit_rate=rates)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "load_max_over_mean": self.load_max_over_mean}

    def table(self) -> str:
        def ms(*values: float, digits: int = 0) -> str:
            # Percentiles of no successful request are NaN: say so instead of printing it.
            if any(math.isnan(v) for v in values):
                return "n/a (no request succeeded)"
            return " / ".join(f"{v:.{digits}f}" for v in values) + " ms"

        rows = [
            ("requests (failed)", f"{self.requests} ({self.failures})"),
            ("duration", f"{self.duration_s:.1f} s"),
            (
                "throughput",
                f"{self.throughput_rps:.2f} req/s, {self.output_tokens_per_s:.0f} tok/s",
            ),
            ("TTFT p50 / p90 / p99", ms(self.ttft_p50_ms, self.ttft_p90_ms, self.ttft_p99_ms)),
            ("e2e p50 / p99", ms(self.e2e_p50_ms, self.e2e_p99_ms)),
            ("inter-token p50", ms(self.itl_p50_ms, digits=1)),
            ("cache hit rate", f"{self.hit_rate:.3f}"),
            ("max/mean requests per worker", f"{self.load_max_over_mean:.2f}"),
        ]
        return "\n".join(f"{k:<30} {v}" for k, v in rows)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def summarize(records: list[RequestRecord]) -> Summary:
    ok = [r for r in records if r.ok]
    hits = HitCounter.from_records(records)
    if records:
        duration = max(r.start + r.e2e_s for r in records) - min(r.start for r in records)
    else:
        duration = 0.0
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    e2e = [r.e2e_s for r in ok]
    return Summary(
        requests=len(records),
        failures=len(records) - len(ok),
        duration_s=duration,
        throughput_rps=len(ok) / duration if duration > 0 else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p90_ms=_pct(ttft, 90),
        ttft_p99_ms=_pct(ttft, 99),
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        itl_p50_ms=_pct(itl, 50),
        hit_rate=hits.hit_rate,
        per_worker_requests=dict(sorted(hits.requests.items())),
        per_worker_hit_rate={w: hits.worker_hit_rate(w) for w in sorted(hits.prompt)},
    )


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


def write_report(records: list[RequestRecord], out_dir: str | Path, title: str = "") -> Summary:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    plot_ttft(records, out / "ttft.png", title)
    plot_latency_over_time(records, out / "latency_over_time.png", title)
    plot_hit_rate_per_worker(summary, out / "hit_rate_per_worker.png", title)
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", type=Path, help="a records.jsonl written by a run")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the plots (default: the records' folder)"
    )


def main(args: argparse.Namespace) -> int:
    from loadtests.metrics import HitCounter, read_records

    records = read_records(args.records)
    summary = write_report(records, args.out or Path(args.records).parent)
    print(summary.table())
    print(HitCounter.from_records(records).table())
    return 0
