"""What the points of a request-rate sweep mean: sustained or not, the saturation point,
the table, the verdict and the latency-vs-load plot (`python -m loadtests sweep`).

A rate is *sustained* when no request failed, answers kept pace with arrivals
(completions per second, first to last answer, at least `KEEP_UP` of the arrivals per
second, first to last due time: below it a queue grows without bound), and, with an SLO,
at least `KEEP_UP` of the answered requests met it. The *saturation point* is the first
rate that is not sustained. A rate that fell behind with many requests sent late (every
user busy) was held back by the client's concurrency cap, not only by the fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.load.metrics import RequestRecord
from loadtests.load.serving import SLO
from loadtests.load.summary import Summary

LATE_S = 0.05  # a send this much after its due time waited for a free user
KEEP_UP = 0.9  # share of the offered rate (and of requests within the SLO) that counts as kept


@dataclass(frozen=True)
class Point:
    policy: str
    rate: float  # asked for, req/s
    offered: float  # arrivals per second, first to last due time (the Poisson draw's own)
    kept: float  # completions per second, first to last answer
    summary: Summary
    late: float = 0.0  # share of requests sent LATE_S or more after they were due

    @property
    def good_share(self) -> float | None:
        s = self.summary.serving
        if s.request_goodput is None:
            return None
        return s.request_goodput / s.request_throughput if s.request_throughput else 0.0

    @property
    def why_not(self) -> str:
        """Why the rate is not sustained ("" when it is)."""
        if self.summary.failures or not self.summary.serving.completed:
            return f"{self.summary.failures} failed"
        if self.kept < KEEP_UP * self.offered:
            # Sent late: every user was busy, so the client's --users cap (max_concurrency)
            # held requests back; with answers as fast as before, that is the client's limit.
            return f"fell behind ({self.late:.0%} sent late)" if self.late >= 0.1 else "fell behind"
        good = self.good_share
        if good is not None and good < KEEP_UP:
            return f"{good:.0%} within the SLO"
        return ""

    @property
    def sustained(self) -> bool:
        return not self.why_not

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "request_rate": self.rate, "offered_rate": self.offered,
                "kept_rate": self.kept, "sent_late": self.late, "sustained": self.sustained,
                **self.summary.to_dict()}  # fmt: skip


def rates_per_s(records: list[RequestRecord]) -> tuple[float, float]:
    """(arrivals per second, answers per second), each over its own first-to-last span."""
    dues = sorted(r.due if r.due is not None else r.start for r in records)
    ends = sorted(r.start + r.e2e_s for r in records if r.ok)

    def per_s(ts: list[float]) -> float:
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else 0.0

    return per_s(dues), per_s(ends)


def late_share(records: list[RequestRecord]) -> float:
    """Share of requests sent LATE_S or more after they were due (open loop only)."""
    due = [r for r in records if r.due is not None]
    return sum(1 for r in due if r.start - r.due >= LATE_S) / len(due) if due else 0.0  # type: ignore[operator]


def sustained_rate(points: list[Point]) -> float | None:
    """The highest rate sustained below the first that is not (None: not even the first)."""
    best = None
    for p in sorted(points, key=lambda p: p.rate):
        if not p.sustained:
            break
        best = p.rate
    return best


def saturation(points: list[Point]) -> float | None:
    """The first rate not sustained (None: every rate was)."""
    return next((p.rate for p in sorted(points, key=lambda p: p.rate) if not p.sustained), None)


def table(results: dict[str, list[Point]]) -> str:
    lines = [
        "| policy | rate (req/s) | offered (req/s) | throughput (req/s) | goodput (req/s) "
        "| TTFT p50 (ms) | TTFT p99 (ms) | TPOT p99 (ms) | hit rate | max/mean per worker "
        "| failed | sustained |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, points in results.items():
        for p in points:
            s = p.summary.serving
            good = "–" if s.request_goodput is None else f"{s.request_goodput:.2f}"
            lines.append(
                f"| {name} | {p.rate:g} | {p.offered:.2f} | {s.request_throughput:.2f} | {good} "
                f"| {s.ttft.p50:.0f} | {s.ttft.p99:.0f} | {s.tpot.p99:.1f} "
                f"| {p.summary.hit_rate:.3f} | {p.summary.load_max_over_mean:.2f} "
                f"| {p.summary.failures} | {'yes' if p.sustained else f'**no**: {p.why_not}'} |"
            )
    return "\n".join(lines)


def _rate_text(points: list[Point], within: str = "") -> str:
    best, sat = sustained_rate(points), saturation(points)
    said = (
        f"{best:g} req/s"
        if best is not None
        else f"less than {min(p.rate for p in points):g} req/s"
    )
    beyond = f"saturates at {sat:g}" if sat is not None else "none of the rates saturated it"
    return f"{said}{within} ({beyond})"


def verdict(results: dict[str, list[Point]], slo: SLO | None) -> str:
    """ "verdict: cache_aware sustains 8 req/s within the SLO (...) (saturates at 16), ..." """
    within = f" within the SLO ({slo.text()} ms)" if slo else " without falling behind"
    ran = [(name, pts) for name, pts in results.items() if pts]
    if not ran:
        return "verdict: nothing ran"
    (name, points), *rest = ran
    text = f"verdict: {name} sustains {_rate_text(points, within)}"
    return text + "".join(f", {n} {_rate_text(pts)}" for n, pts in rest)


def plot(results: dict[str, list[Point]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("TTFT p99 (ms)", lambda p: p.summary.serving.ttft.p99),
        ("TPOT p99 (ms)", lambda p: p.summary.serving.tpot.p99),
        ("throughput (req/s)", lambda p: p.summary.serving.request_throughput),
    ]
    for ax, (label, f) in zip(axes, panels, strict=True):
        for name, points in results.items():
            xs = [p.offered for p in points]
            line = ax.plot(xs, [f(p) for p in points], marker="o", label=name)[0]
            sat = [p for p in points if not p.sustained]
            ax.scatter([p.offered for p in sat], [f(p) for p in sat], marker="x", s=80,
                       color=line.get_color(), zorder=3)  # fmt: skip
        ax.set(xlabel="offered load (req/s, Poisson)", ylabel=label, title=label)
        ax.grid(alpha=0.3)
    for name, points in results.items():  # goodput under the throughput, dashed (with --slo)
        good = [(p.offered, p.summary.serving.request_goodput) for p in points]
        if good and all(g is not None for _, g in good):
            color = next(ln.get_color() for ln in axes[2].get_lines() if ln.get_label() == name)
            axes[2].plot(*zip(*good, strict=True), ls=":", marker=".", color=color,
                         label=f"{name} goodput")  # fmt: skip
    axes[2].set_ylabel("throughput, goodput (req/s)")
    top = max((p.offered for pts in results.values() for p in pts), default=1.0)
    axes[2].plot([0, top], [0, top], ls="--", lw=0.8, color="gray", label="offered")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8, title="× not sustained", title_fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
