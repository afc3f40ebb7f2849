"""A request-rate sweep: the load each routing policy sustains within an SLO, and where it saturates.

    python -m loadtests sweep --rates 2,4,8,16 --workload shared_prefix \\
        --policies cache_aware,cost_aware,round_robin --slo ttft=500,tpot=50 --out loadtests/out/sweep

For each policy, and each rate in turn, the load is offered open loop: a Poisson
process of RATE requests per second (a Mooncake trace with `--arrival trace` keeps its
own arrivals, sped up to that mean rate), at most `--users` in flight (vLLM's
max_concurrency), `--seconds` worth of requests. Without `--host` it runs on a local sim
fleet of its own (loadtests/load/cluster.py; the fleet knobs and workload defaults of
`compare`): before each rate the router restarts with the policy and every worker's cache
is flushed, so each point meets the same cold cluster. With `--host` it sweeps that server
as it is (one line, `host`; `--policies` is ignored).

Each point has three rates (`rates_per_s`): *offered* (arrivals per second, first to
last due time), *sent* (requests the client sent, over at least that span: fewer when
every user was busy) and *answered* (completions, over at least the sending span). Each
is (count - 1) / span and each span only widens in that order, so answered never
exceeds sent and sent never exceeds offered (rate 1 once showed 0.76 answered against
0.67 offered: vLLM's throughput divides n, not n - 1, by a span of its own).
A rate is *sustained* when no request failed, answers kept pace with arrivals
(answered at least `KEEP_UP` of offered: below it a queue grows without bound), and, with an SLO,
at least `KEEP_UP` of the answered requests met it. The *saturation point* is the first
rate that is not sustained. A rate that fell behind with many requests sent late (every
user busy) was held back by the client's concurrency cap, not only by the cluster. A
policy's sweep stops at its saturation point (`--keep-going` runs every rate).
Prints one table (per policy and rate: offered, sent and answered req/s, goodput, TTFT
and TPOT p99, hit rate, spread), writes `sweep.json` (each point under vLLM's field names) and
`sweep.png` (latency vs offered load, one line per policy), and ends with a verdict:
"cache_aware sustains 8 req/s within the SLO, round_robin 4".

    python -m loadtests sweep --multi-tenant --rates 0.5,1,1.5,2 [--before-ref main]

`--multi-tenant` sweeps the fleet queue's workload instead (`fleet-queue`,
loadtests/load/fleet_queue.py: `--tenants` tenants, one sending `--flood` times its
share, three classes, open loop) through today's router (`--before-ref`) and this tree's,
side by side, each rate a multiple of the fleet's saturation rate and every rate run
(past saturation is the point). The fleet and the workload's other knobs are
`fleet-queue`'s defaults; `--workload` (shared_prefix or multi_turn) and `--seconds`
apply. Per side and rate: goodput at SLO, attainment per class, hit rate, Jain, 429 and
503; a rate is *kept* when the interactive class met its TTFT objective for at least
`INTERACTIVE_KEPT` of its requests and no request was answered 503 (issue 35's bar for
past saturation; goodput alone cannot say it, as a batch objective longer than the run
counts the backlog served after it as met).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.kit import (
    Progress,
    WorkloadOptions,
    add_workload_arguments,
    clock_text,
    options_from_namespace,
)
from loadtests.load import fleet_queue
from loadtests.load.cluster import Cluster, ClusterSpec
from loadtests.load.compare import POLICIES, WORKLOAD_DEFAULTS, RouterSpec
from loadtests.load.records import RequestRecord, read_records
from loadtests.load.runner import RunSpec, run
from loadtests.load.summary import SLO, Summary
from loadtests.load.workloads import read_trace

LATE_S = 0.05  # a send this much after its due time waited for a free user
KEEP_UP = 0.9  # share of the offered rate (and of requests within the SLO) that counts as kept
INTERACTIVE_KEPT = 0.99  # --multi-tenant: interactive attainment that keeps a rate


@dataclass(frozen=True)
class Point:
    policy: str
    rate: float  # asked for, req/s
    offered: float  # arrivals per second, first to last due time (the Poisson draw's own)
    answered: float  # completions per second (rates_per_s: never above sent)
    summary: Summary
    late: float = 0.0  # share of requests sent LATE_S or more after they were due
    sent: float | None = None  # requests sent per second (never above offered); None: offered

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
        if self.answered < KEEP_UP * self.offered:
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
                "sent_rate": self.sent_rate, "answered_rate": self.answered,
                "sent_late": self.late, "sustained": self.sustained,
                **self.summary.to_dict()}  # fmt: skip

    @property
    def sent_rate(self) -> float:
        return self.offered if self.sent is None else self.sent

    @property
    def goodput(self) -> float | None:
        """Answered requests within the SLO per second, on the answered rate's span."""
        good = self.good_share
        return None if good is None else self.answered * good


def rates_per_s(records: list[RequestRecord]) -> tuple[float, float, float]:
    """(offered, sent, answered) per second: each (count - 1) over a span at least as wide
    as the one before, so answered <= sent <= offered whatever the latencies."""
    dues = sorted(r.due if r.due is not None else r.start for r in records)
    sends = sorted(r.start for r in records)
    ends = sorted(r.start + r.e2e_s for r in records if r.ok)

    def span(ts: list[float]) -> float:
        return ts[-1] - ts[0] if len(ts) > 1 else 0.0

    def per_s(n: int, seconds: float) -> float:
        return (n - 1) / seconds if n > 1 and seconds > 0 else 0.0

    offered_s = span(dues)
    sent_s = max(span(sends), offered_s)
    answered_s = max(span(ends), sent_s)
    return per_s(len(dues), offered_s), per_s(len(sends), sent_s), per_s(len(ends), answered_s)


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
        "| policy | rate (req/s) | offered (req/s) | sent (req/s) | answered (req/s) "
        "| goodput (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p99 (ms) | hit rate "
        "| max/mean per worker | failed | sustained |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, points in results.items():
        for p in points:
            s = p.summary.serving
            good = "–" if p.goodput is None else f"{p.goodput:.2f}"
            lines.append(
                f"| {name} | {p.rate:g} | {p.offered:.2f} | {p.sent_rate:.2f} | {p.answered:.2f} "
                f"| {good} "
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
        ("answered (req/s)", lambda p: p.answered),
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
    for name, points in results.items():  # goodput under the answered rate, dashed (--slo)
        good = [(p.offered, p.goodput) for p in points]
        if good and all(g is not None for _, g in good):
            color = next(ln.get_color() for ln in axes[2].get_lines() if ln.get_label() == name)
            axes[2].plot(*zip(*good, strict=True), ls=":", marker=".", color=color,
                         label=f"{name} goodput")  # fmt: skip
    axes[2].set_ylabel("answered, goodput (req/s)")
    top = max((p.offered for pts in results.values() for p in pts), default=1.0)
    axes[2].plot([0, top], [0, top], ls="--", lw=0.8, color="gray", label="offered")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8, title="× not sustained", title_fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


DEFAULT_POLICIES = "cache_aware,cost_aware,round_robin"
HOST = "host"


def policy_spec(name: str) -> RouterSpec:
    """`compare`'s names ("cache_aware (fleet)", ...) or a router policy at its defaults."""
    return POLICIES.get(name) or RouterSpec(name)


def load_for(
    workload: WorkloadOptions, rate: float, seconds: float
) -> tuple[WorkloadOptions, float, int]:
    """(workload, Poisson rate for locust, requests) for one point: a trace replayed at its
    own arrivals is sped up to `rate` on average; everything else is Poisson at `rate`."""
    n = max(8, math.ceil(rate * seconds))
    if workload.workload == "mooncake" and workload.arrival == "trace":
        trace = read_trace(workload.trace, workload.trace_limit)
        n = min(n, len(trace))
        span_s = (float(trace[n - 1]["timestamp"]) - float(trace[0]["timestamp"])) / 1000  # type: ignore[arg-type]
        speedup = rate * span_s / (n - 1) if span_s > 0 else 1.0  # rate / the trace's rate
        return replace(workload, speedup=speedup, loop=False), 0.0, n
    return replace(workload, loop=True), rate, n


def run_point(
    policy: str, rate: float, workload: WorkloadOptions, spec: RunSpec, seconds: float,
    cluster: Cluster | None, settings: dict[str, str],
) -> Point:  # fmt: skip
    if cluster is not None:
        ps = policy_spec(policy)
        cluster.start_router(
            {**settings, "policy": ps.policy, **ps.settings, "log_level": "WARNING"}
        )
        cluster.flush()
        spec = replace(spec, host=cluster.router_url, model=spec.model or "sim")
    load, poisson, n = load_for(workload, rate, seconds)
    out = spec.out / policy.replace(" ", "_").replace("(", "").replace(")", "") / f"rate_{rate:g}"
    at = replace(spec, out=out, request_rate=poisson, max_requests=n)
    summary = run(at, load, title=f"{workload.workload}: {policy}, {rate:g} req/s", quiet=True)
    records = read_records(out / "records.jsonl")
    offered, sent, answered = rates_per_s(records)
    return Point(policy, rate, offered, answered, summary, late_share(records), sent)


def sweep(
    workload: WorkloadOptions, rates: list[float], policies: list[str], spec: RunSpec,
    seconds: float, cluster_spec: ClusterSpec | None = None, settings: dict[str, str] | None = None,
    keep_going: bool = False,
) -> dict[str, list[Point]]:  # fmt: skip
    """Every policy over the rates (lowest first). `cluster_spec` None: `spec.host` as it is."""
    names = policies if cluster_spec is not None else [HOST]
    progress = Progress("sweep", len(names) * len(rates) + (cluster_spec is not None))
    results: dict[str, list[Point]] = {name: [] for name in names}
    cluster = None
    if cluster_spec is not None:
        progress.say(f"starting Redis and {cluster_spec.workers} sim workers")
        cluster = cluster_spec.start()
        progress.finished()
    try:
        for name in names:
            for i, rate in enumerate(sorted(rates)):
                progress.say(f"{name}: {rate:g} req/s")
                p = run_point(name, rate, workload, spec, seconds, cluster, settings or {})
                results[name].append(p)
                s = p.summary.serving
                progress.finished(
                    f"{name} at {rate:g} req/s: offered {p.offered:.2f}, sent "
                    f"{p.sent_rate:.2f}, answered {p.answered:.2f} req/s, TTFT p99 "
                    f"{s.ttft.p99:.0f} ms: {p.why_not or 'sustained'}"
                )
                if not p.sustained and not keep_going:
                    progress.done += len(rates) - i - 1  # the rest of this policy is skipped
                    break
    finally:
        if cluster is not None:
            cluster.close()
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--rates", required=True, help="request rates to offer, req/s, e.g. 1,2,4,8")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"router policies (or `compare`'s names), comma-separated {d}")  # fmt: skip
    p.add_argument(
        "--slo", default="", help="goodput objectives per request, ms, e.g. ttft=500,tpot=50"
    )
    p.add_argument(
        "--host", default=None, help="sweep this server as it is (default: a local sim cluster)"
    )
    p.add_argument(
        "--seconds", type=float, default=20.0, help=f"requests per rate: rate × this {d}"
    )
    p.add_argument(
        "--users", type=int, default=64, help=f"most requests in flight (max_concurrency) {d}"
    )
    p.add_argument("--keep-going", action="store_true", help="every rate, also past saturation")
    p.add_argument(
        "--multi-tenant", action="store_true",
        help="fleet-queue's tenants and classes, today's router vs this tree; "
        "--rates are multiples of saturation",
    )  # fmt: skip
    p.add_argument("--before-ref", default="main", help=f"--multi-tenant: today's router {d}")
    p.add_argument("--tenants", type=int, default=8, help=f"--multi-tenant: tenants {d}")
    p.add_argument(
        "--flood", type=float, default=10.0, help=f"--multi-tenant: t0 sends this x its share {d}"
    )
    p.add_argument("--workers", type=int, default=4, help=f"sim workers {d}")
    p.add_argument(
        "--cache-tokens", type=int, default=4096, help=f"KV capacity per sim worker, tokens {d}"
    )
    p.add_argument(
        "--prefill-us", type=float, default=100.0, help=f"sim prefill, µs per uncached token {d}"
    )
    p.add_argument("--decode-ms", type=float, default=2.0, help=f"sim decode step, ms {d}")
    p.add_argument(
        "--max-running", type=int, default=8, help=f"requests a sim worker runs at once {d}"
    )
    p.add_argument(
        "--out", type=Path, default=Path("loadtests/out/sweep"), help=f"report folder {d}"
    )
    add_workload_arguments(p, defaults=WORKLOAD_DEFAULTS)


def main(args: argparse.Namespace) -> int:
    rates = sorted({float(r) for r in args.rates.split(",") if r.strip()})
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates wants positive req/s, comma-separated, got {args.rates!r}")
    if args.multi_tenant:
        return multi_tenant(args, rates)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    slo = SLO.parse(args.slo)
    workload = options_from_namespace(args)
    spec = RunSpec(host=args.host or "", out=args.out, users=args.users, slo=slo)
    cluster = None
    if args.host is None:
        cluster = ClusterSpec(
            workers=args.workers, cache_tokens=args.cache_tokens, prefill_us_per_token=args.prefill_us,
            decode_ms_per_token=args.decode_ms, max_running_requests=args.max_running,
        )  # fmt: skip
    # The imbalance gap at half a worker's batch, as `compare` and `radix-router up` set it.
    settings = {"balance_abs_threshold": str(max(1, args.max_running // 2))}
    started = time.monotonic()
    results = sweep(
        workload, rates, policies, spec, args.seconds, cluster, settings, args.keep_going
    )
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {name: [p.to_dict() for p in pts] for name, pts in results.items()}
    (args.out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    where = f"{args.workers} sim workers" if cluster else args.host
    plot(results, args.out / "sweep.png", f"{workload.workload}, {where}: latency vs load")
    print(f"plot: {args.out / 'sweep.png'}")
    print(f"{verdict(results, slo)} ({clock_text(time.monotonic() - started)})")
    return 0


# -- --multi-tenant: the fleet queue's workload past saturation --------------------------
def kept(run: dict) -> bool:
    """Interactive attainment at least INTERACTIVE_KEPT, and no 503."""
    classes = run["classes"]
    attained = classes["interactive"]["attainment"]
    no_503 = not any(c["503"] for c in classes.values())
    return no_503 and (attained is None or attained >= INTERACTIVE_KEPT)


def multi_tenant_table(results: dict) -> str:
    lines = [
        "| router | load (x saturation) | offered (req/s) | goodput@SLO (req/s) | interactive "
        "| standard | batch | hit rate | Jain | 429 | 503 | kept |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results["runs"], key=lambda r: (r["side"], r["load"])):
        c = r["classes"]
        att = [fleet_queue._pct(c[k]["attainment"]) for k in fleet_queue.CLASSES]
        hit = fleet_queue._pct(r["hit_rate"])
        refused = sum(c[k]["429"] for k in c)
        failed = sum(c[k]["503"] for k in c)
        lines.append(
            f"| {r['side']} | {r['load']:g} | {r['rate_rps']:.1f} | {r['goodput_rps']:.2f} "
            f"| {' | '.join(att)} | {hit} | {r['jain']:.3f} | {refused} | {failed} "
            f"| {'yes' if kept(r) else '**no**'} |"
        )
    return "\n".join(lines)


def multi_tenant_verdict(results: dict) -> str:
    """ "verdict (...): this tree keeps interactive at 0.5-2x, goodput 9.9 / 19.7 req/s ..." """
    sides: dict[str, list[dict]] = {}
    for r in sorted(results["runs"], key=lambda r: r["load"]):
        sides.setdefault(r["side"], []).append(r)
    said = []
    for side, runs in sides.items():
        held = [f"{r['load']:g}x" for r in runs if kept(r)]
        goodput = " / ".join(f"{r['goodput_rps']:.1f}" for r in runs)
        loads = " / ".join(f"{r['load']:g}x" for r in runs)
        where = ", ".join(held) if held else "no rate"
        said.append(f"{side} keeps interactive at {where}; goodput {goodput} req/s at {loads}")
    sat = results["saturation_rps"]
    return f"verdict ({results['args']['workload']}, saturation {sat:.1f} req/s): " + "; ".join(
        said
    )


def multi_tenant(args: argparse.Namespace, loads: list[float]) -> int:
    ns = fleet_queue.defaults()
    ns.loads = ",".join(f"{x:g}" for x in loads)
    ns.seconds, ns.before_ref = args.seconds, args.before_ref
    ns.tenants, ns.flood = args.tenants, args.flood
    if args.workload in ("shared_prefix", "multi_turn"):
        ns.workload = args.workload
    started = time.monotonic()
    results = fleet_queue.run(ns)
    print(multi_tenant_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{multi_tenant_verdict(results)} ({clock_text(time.monotonic() - started)})")
    return 0
