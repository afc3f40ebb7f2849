"""Routing policies side by side: one local sim fleet, the same workload under each policy.

    python -m loadtests compare --workers 4 --workload shared_prefix --groups 16 \\
        --prompts-per-group 8 --system-len 1024 --users 32 --out loadtests/out/compare

For each policy the router restarts with it and every worker's cache is flushed, so
each policy meets the same cold fleet and the same requests in the same order. SGLang's
Rust router (`sglang-router`, in its own venv: `--sglang-python VENV/bin/python`) joins
as a peer over the same workers; its per-worker counts come from the workers' /metrics
(it names no worker in its answers).
Prints one table (throughput, TTFT p50/p99, hit rate, max/mean requests per worker)
and the cache-aware / round-robin hit-rate ratio, and saves `policies.png`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.fleet import FleetSpec, LocalFleet, RouterSpec
from loadtests.options import WorkloadOptions, add_workload_arguments, options_from_namespace
from loadtests.report import Summary
from loadtests.runner import RunSpec, run

SGLANG = "sglang-router"  # SGLang's Rust router, cache_aware at its defaults
POLICIES: dict[str, RouterSpec] = {
    "cache_aware (fleet)": RouterSpec("cache_aware", {"balance_mode": "fleet"}),
    "cache_aware (per_request)": RouterSpec("cache_aware", {"balance_mode": "per_request"}),
    "cost_aware": RouterSpec("cost_aware"),
    "round_robin": RouterSpec("round_robin"),
    "least_load": RouterSpec("least_load"),
    "power_of_two": RouterSpec("power_of_two"),
}


def table(results: dict[str, Summary]) -> str:
    lines = [
        "| policy | throughput (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | hit rate | max/mean requests per worker | failures |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s.throughput_rps:.2f} | {s.ttft_p50_ms:.0f} | {s.ttft_p99_ms:.0f} | "
            f"{s.hit_rate:.3f} | {s.load_max_over_mean:.2f} | {s.failures} |"
        )
    ca, rr = results.get("cache_aware (fleet)"), results.get("round_robin")
    if ca and rr:
        ratio = ca.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
        lines.append("")
        lines.append(f"cache_aware (fleet) / round_robin hit rate: {ratio:.2f}x")
    return "\n".join(lines)


def plot(results: dict[str, Summary], path: Path, title: str) -> None:
    names = list(results)
    short = [n.replace("cache_aware ", "ca ").replace("(per_request)", "(per_req)") for n in names]
    metrics = [
        ("throughput (req/s)", [results[n].throughput_rps for n in names]),
        ("TTFT p50 (ms)", [results[n].ttft_p50_ms for n in names]),
        ("TTFT p99 (ms)", [results[n].ttft_p99_ms for n in names]),
        ("cache hit rate", [results[n].hit_rate for n in names]),
        ("max/mean requests per worker", [results[n].load_max_over_mean for n in names]),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4))
    colors = ["#4878d0", "#6acc64", "#ee854a", "#d65f5f", "#956cb4", "#8c613c"]
    for ax, (label, values) in zip(axes, metrics, strict=True):
        ax.bar(range(len(names)), values, color=colors[: len(names)])
        ax.set_title(label, fontsize=9)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(short, rotation=40, ha="right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def compare(
    fleet_spec: FleetSpec,
    workload: WorkloadOptions,
    run_spec: RunSpec,
    policies: list[str],
    settings: dict[str, str] | None = None,
    sglang_python: str | None = None,
) -> dict[str, Summary]:
    """``settings``: RouterConfig keys for every router (thresholds, no_match, ...);
    a policy's own keys (balance_mode) win. ``sglang_python``: a Python with
    `sglang-router` installed; SGLang's router then runs last, as ``sglang-router``."""
    results: dict[str, Summary] = {}
    names = list(policies) + ([SGLANG] if sglang_python else [])
    with LocalFleet(fleet_spec) as fleet:
        for name in names:
            if name == SGLANG:
                assert sglang_python is not None
                fleet.start_sglang_router(sglang_python)
            else:
                spec = POLICIES[name]
                fleet.restart_router(RouterSpec(spec.policy, {**(settings or {}), **spec.settings}))
            fleet.flush()
            before = fleet.worker_requests()
            out = run_spec.out / name.replace(" ", "_").replace("(", "").replace(")", "")
            # Every request names the sim workers' model: SGLang's router requires one.
            run_at = RunSpec(**{**run_spec.__dict__, "host": fleet.router_url, "out": out,
                                "model": run_spec.model or "sim"})  # fmt: skip
            summary = run(run_at, workload, title=f"{workload.workload}: {name}", quiet=True)
            # Idle workers count: the records only name the workers that got requests.
            results[name] = summary.over_fleet(f"w{i}" for i in range(fleet_spec.workers))
            if name == SGLANG:  # no x-radix-worker header: count at the workers instead
                after = fleet.worker_requests()
                counts = {w: after[w] - before[w] for w in after}
                results[name] = replace(results[name], per_worker_requests=counts)
            print(
                f"{name}: {results[name].throughput_rps:.2f} req/s, hit rate {results[name].hit_rate:.3f}"
            )
    if sglang_python is None:
        print("no --sglang-python: SGLang's router skipped")
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=65_536, help="KV capacity per worker")
    p.add_argument(
        "--prefill-us", type=float, default=30.0, help="sim prefill µs per uncached token"
    )
    p.add_argument("--decode-ms", type=float, default=3.0, help="sim decode ms per token")
    p.add_argument("--max-running", type=int, default=8, help="requests a worker runs at once")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, from: " + ", ".join(POLICIES),
    )
    p.add_argument(
        "--router-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a RouterConfig key for every router, e.g. balance_abs_threshold=8 (repeatable)",
    )
    p.add_argument(
        "--sglang-python",
        default=None,
        help="a Python with sglang-router installed (its own venv): adds SGLang's router",
    )
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--run-time", default=None)
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtests/out/compare"))
    p.add_argument(
        "--plot", type=Path, default=None, help="bar chart path (default: OUT/policies.png)"
    )
    add_workload_arguments(p)


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--router-setting wants KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    fleet = FleetSpec(
        workers=args.workers, cache_tokens=args.cache_tokens, prefill_us_per_token=args.prefill_us,
        decode_ms_per_token=args.decode_ms, max_running_requests=args.max_running,
    )  # fmt: skip
    workload = options_from_namespace(args)
    run_spec = RunSpec(
        host="",
        out=args.out,
        users=args.users,
        run_time=args.run_time,
        max_requests=args.max_requests,
    )
    settings = dict(_setting(s) for s in args.router_setting)
    results = compare(fleet, workload, run_spec, policies, settings, args.sglang_python)
    text = table(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(
        json.dumps({k: v.to_dict() for k, v in results.items()}, indent=2) + "\n"
    )
    chart = args.plot or args.out / "policies.png"
    plot(results, chart, f"{workload.workload}, {args.workers} sim workers")
    print(f"chart: {chart}")
    return 0
