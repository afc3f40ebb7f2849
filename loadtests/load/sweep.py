"""A request-rate sweep: the load each routing policy sustains within an SLO, and where it saturates.

    python -m loadtests sweep --rates 2,4,8,16 --workload shared_prefix \\
        --policies cache_aware,cost_aware,round_robin --slo ttft=500,tpot=50 --out loadtests/out/sweep

For each policy, and each rate in turn, the load is offered open loop: a Poisson
process of RATE requests per second (a Mooncake trace with `--arrival trace` keeps its
own arrivals, sped up to that mean rate), at most `--users` in flight (vLLM's
max_concurrency), `--seconds` worth of requests. Without `--host` it runs on a local sim
fleet of its own (loadtests/load/cluster.py; the fleet knobs and workload defaults of
`compare`): before each rate the router restarts with the policy and every worker's cache
is flushed, so each point meets the same cold fleet. With `--host` it sweeps that server
as it is (one line, `host`; `--policies` is ignored).

A rate is *sustained* when no request failed, answers kept pace with arrivals (0.9 of
the offered rate) and, with `--slo`, 90% of the answered requests met it; the
*saturation point* is the first rate that is not (loadtests/load/saturation.py says exactly
how each is measured). A policy's sweep stops at its saturation point (`--keep-going`
runs every rate).
Prints one table (per policy and rate: throughput, goodput, TTFT and TPOT p99, hit
rate, spread), writes `sweep.json` (each point under vLLM's field names) and
`sweep.png` (latency vs offered load, one line per policy), and ends with a verdict:
"cache_aware sustains 8 req/s within the SLO, round_robin 4".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from loadtests.load.cluster import BenchFleet, FleetSpec
from loadtests.load.compare import POLICIES, WORKLOAD_DEFAULTS, RouterSpec
from loadtests.load.metrics import read_records
from loadtests.load.runner import RunSpec, run
from loadtests.load.saturation import Point, late_share, plot, rates_per_s, table, verdict
from loadtests.load.serving import SLO
from loadtests.load.workloads import read_trace
from loadtests.options import WorkloadOptions, add_workload_arguments, options_from_namespace
from loadtests.progress import Progress, clock_text

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
    fleet: BenchFleet | None, settings: dict[str, str],
) -> Point:  # fmt: skip
    if fleet is not None:
        ps = policy_spec(policy)
        fleet.start_router({**settings, "policy": ps.policy, **ps.settings, "log_level": "WARNING"})
        fleet.flush()
        spec = replace(spec, host=fleet.router_url, model=spec.model or "sim")
    load, poisson, n = load_for(workload, rate, seconds)
    out = spec.out / policy.replace(" ", "_").replace("(", "").replace(")", "") / f"rate_{rate:g}"
    at = replace(spec, out=out, request_rate=poisson, max_requests=n)
    summary = run(at, load, title=f"{workload.workload}: {policy}, {rate:g} req/s", quiet=True)
    records = read_records(out / "records.jsonl")
    offered, kept = rates_per_s(records)
    return Point(policy, rate, offered, kept, summary, late_share(records))


def sweep(
    workload: WorkloadOptions, rates: list[float], policies: list[str], spec: RunSpec,
    seconds: float, fleet_spec: FleetSpec | None = None, settings: dict[str, str] | None = None,
    keep_going: bool = False,
) -> dict[str, list[Point]]:  # fmt: skip
    """Every policy over the rates (lowest first). `fleet_spec` None: `spec.host` as it is."""
    names = policies if fleet_spec is not None else [HOST]
    progress = Progress("sweep", len(names) * len(rates) + (fleet_spec is not None))
    results: dict[str, list[Point]] = {name: [] for name in names}
    fleet = None
    if fleet_spec is not None:
        progress.say(f"starting Redis and {fleet_spec.workers} sim workers")
        fleet = fleet_spec.start()
        progress.finished()
    try:
        for name in names:
            for i, rate in enumerate(sorted(rates)):
                progress.say(f"{name}: {rate:g} req/s")
                p = run_point(name, rate, workload, spec, seconds, fleet, settings or {})
                results[name].append(p)
                s = p.summary.serving
                progress.finished(
                    f"{name} at {rate:g} req/s: {s.request_throughput:.2f} req/s answered, "
                    f"kept {p.kept:.2f} of {p.offered:.2f} offered, TTFT p99 "
                    f"{s.ttft.p99:.0f} ms: {p.why_not or 'sustained'}"
                )
                if not p.sustained and not keep_going:
                    progress.done += len(rates) - i - 1  # the rest of this policy is skipped
                    break
    finally:
        if fleet is not None:
            fleet.close()
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
        "--host", default=None, help="sweep this server as it is (default: a local sim fleet)"
    )
    p.add_argument(
        "--seconds", type=float, default=20.0, help=f"requests per rate: rate × this {d}"
    )
    p.add_argument(
        "--users", type=int, default=64, help=f"most requests in flight (max_concurrency) {d}"
    )
    p.add_argument("--keep-going", action="store_true", help="every rate, also past saturation")
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
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    slo = SLO.parse(args.slo)
    workload = options_from_namespace(args)
    spec = RunSpec(host=args.host or "", out=args.out, users=args.users, slo=slo)
    fleet = None
    if args.host is None:
        fleet = FleetSpec(
            workers=args.workers, cache_tokens=args.cache_tokens, prefill_us_per_token=args.prefill_us,
            decode_ms_per_token=args.decode_ms, max_running_requests=args.max_running,
        )  # fmt: skip
    # The imbalance gap at half a worker's batch, as `compare` and `radix-router up` set it.
    settings = {"balance_abs_threshold": str(max(1, args.max_running // 2))}
    started = time.monotonic()
    results = sweep(workload, rates, policies, spec, args.seconds, fleet, settings, args.keep_going)
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {name: [p.to_dict() for p in pts] for name, pts in results.items()}
    (args.out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    where = f"{args.workers} sim workers" if fleet else args.host
    plot(results, args.out / "sweep.png", f"{workload.workload}, {where}: latency vs load")
    print(f"plot: {args.out / 'sweep.png'}")
    print(f"{verdict(results, slo)} ({clock_text(time.monotonic() - started)})")
    return 0
