"""Summary and plots of one load-test run, computed from its per-request records.

`summarize(records, slo, workers)` gives the numbers: vLLM's serving metrics (TTFT,
TPOT, ITL, E2E latency, throughput, goodput; loadtests/serving.py) for the run and per
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
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: works headless and in CI
import matplotlib.pyplot as plt
import numpy as np

from loadtests.metrics import HitCounter, RequestRecord
from loadtests.serving import SLO, Latency, ServingMetrics, per_worker, serving_metrics


@dataclass(frozen=True)
class Summary:
    requests: int  # sent, failed ones included
    failures: int
    serving: ServingMetrics  # the whole run, vLLM's metrics (loadtests/serving.py)
    hit_rate: float
    per_worker_requests: dict[str, int]
    per_worker_hit_rate: dict[str, float]
    per_worker_serving: dict[str, ServingMetrics]
    slo: SLO | None = None

    # The figures every caller reads, from the serving metrics.
    duration_s = property(lambda self: self.serving.duration)
    throughput_rps = property(lambda self: self.serving.request_throughput)
    output_tokens_per_s = property(lambda self: self.serving.output_throughput)
    ttft_p50_ms = property(lambda self: self.serving.ttft.p50)
    ttft_p90_ms = property(lambda self: self.serving.ttft.p90)
    ttft_p99_ms = property(lambda self: self.serving.ttft.p99)
    e2e_p50_ms = property(lambda self: self.serving.e2el.p50)
    e2e_p99_ms = property(lambda self: self.serving.e2el.p99)
    itl_p50_ms = property(lambda self: self.serving.itl.p50)

    @property
    def load_max_over_mean(self) -> float:
        """Max / mean requests per worker, over every worker listed: 1.0 is an even spread."""
        counts = list(self.per_worker_requests.values())
        return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else 0.0

    def over_fleet(self, worker_ids: Iterable[str]) -> Summary:
        """The same run, with the fleet's idle workers counted (0 requests): a policy
        that sends everything to one of 4 workers spreads max/mean 4.0, not 1.0."""
        ids = list(worker_ids)
        counts = dict(sorted((dict.fromkeys(ids, 0) | self.per_worker_requests).items()))
        rates = dict.fromkeys(ids, 0.0) | self.per_worker_hit_rate
        idle = serving_metrics([], self.slo, self.serving.duration)
        per = dict(sorted((dict.fromkeys(ids, idle) | self.per_worker_serving).items()))
        return replace(self, per_worker_requests=counts, per_worker_hit_rate=rates,
                       per_worker_serving=per)  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        """The result file: vLLM's field names where the meaning is the same, then ours."""
        return {
            **self.serving.to_vllm(),
            "requests": self.requests,
            "slo": self.slo.text() if self.slo else None,
            "hit_rate": self.hit_rate,
            "load_max_over_mean": self.load_max_over_mean,
            "per_worker": {
                w: {
                    "requests": n,
                    "hit_rate": self.per_worker_hit_rate.get(w, 0.0),
                    **self.per_worker_serving[w].to_vllm(),
                }
                for w, n in self.per_worker_requests.items()
            },
        }

    def table(self) -> str:
        s = self.serving
        goodput = "no --slo given"
        if self.slo is not None and s.request_goodput is not None:
            share = s.request_goodput / s.request_throughput if s.request_throughput else 0.0
            goodput = (
                f"{s.request_goodput:.2f} req/s ({share:.0%} of requests meet {self.slo.text()} ms)"
            )
        # A latency without values: nothing succeeded, or answers came whole (no stream).
        none = "n/a (no request succeeded)" if not s.completed else "n/a (no streamed answer)"
        rows = [
            ("requests (failed)", f"{self.requests} ({self.failures})"),
            ("duration", f"{s.duration:.1f} s"),
            ("request throughput", f"{s.request_throughput:.2f} req/s"),
            ("output token throughput", f"{s.output_throughput:.0f} tok/s"),
            ("total token throughput", f"{s.total_token_throughput:.0f} tok/s"),
            ("goodput", goodput),
            ("", "mean / p50 / p90 / p99"),
            ("TTFT", _ms(s.ttft, none)),
            ("TPOT", _ms(s.tpot, none, 1)),
            ("ITL", _ms(s.itl, none, 1)),
            ("E2E latency", _ms(s.e2el, none)),
            ("cache hit rate", f"{self.hit_rate:.3f} (cached / prompt tokens)"),
            ("max/mean requests per worker", f"{self.load_max_over_mean:.2f} "
             f"(over {len(self.per_worker_requests)} workers; 1.00 is even)"),
        ]  # fmt: skip
        return "\n".join(f"{k:<30} {v}" for k, v in rows)

    def worker_table(self) -> str:
        """One line per worker, idle ones included."""
        head = (f"{'worker':<16} {'requests':>8} {'failed':>6} {'hit rate':>8} {'req/s':>7} "
                f"{'goodput req/s':>13} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
                f"{'TPOT p99 ms':>11} {'E2E p99 ms':>10}")  # fmt: skip
        lines = [head]
        for w, n in self.per_worker_requests.items():
            m = self.per_worker_serving[w]
            good = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
            lines.append(
                f"{w:<16} {n:>8} {m.failed:>6} {self.per_worker_hit_rate.get(w, 0.0):>8.3f} "
                f"{m.request_throughput:>7.2f} {good:>13} {_v(m.ttft.p50):>11} "
                f"{_v(m.ttft.p99):>11} {_v(m.tpot.p99, 1):>11} {_v(m.e2el.p99):>10}"
            )
        return "\n".join(lines)


def _v(x: float, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _ms(lat: Latency, none: str, digits: int = 0) -> str:
    if math.isnan(lat.mean):  # say why instead of printing NaN
        return none
    values = (lat.mean, lat.p50, lat.p90, lat.p99)
    return " / ".join(f"{v:.{digits}f}" for v in values) + " ms"


def summarize(
    records: list[RequestRecord], slo: SLO | None = None, workers: Iterable[str] = ()
) -> Summary:
    """`workers`: the fleet's worker ids (the router's GET /workers), so that a worker
    that got no request is listed and counted in the spread."""
    hits = HitCounter.from_records(records)
    serving = serving_metrics(records, slo)
    # Per worker: its answered requests (a request the router refused itself names no
    # worker), over the whole run's duration so that the throughputs add up.
    ok = [r for r in records if r.ok]
    return Summary(
        requests=len(records),
        failures=len(records) - len(ok),
        serving=serving,
        hit_rate=hits.hit_rate,
        per_worker_requests=dict(sorted(hits.requests.items())),
        per_worker_hit_rate={w: hits.worker_hit_rate(w) for w in sorted(hits.prompt)},
        per_worker_serving=per_worker(ok, (), slo, serving.duration),
        slo=slo,
    ).over_fleet(workers)


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
    from loadtests.metrics import read_records

    records = read_records(args.records)
    summary = write_report(records, args.out or Path(args.records).parent, slo=SLO.parse(args.slo))
    print(summary.table())
    print(summary.worker_table())
    return 0
