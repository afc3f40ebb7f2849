"""Routing policies side by side: one local sim fleet, the same workload under each policy.

    python -m loadtests compare                      # the defaults: under a minute on 2 cores
    python -m loadtests compare --policies all --groups 16 --users 32 --out loadtests/out/compare
    python -m loadtests compare --workload multi_turn --host-cache-tokens 0,16384  # a host KV tier
    python -m loadtests compare --kv-events --policies cost_aware   # tree alone vs + events
    python -m loadtests compare --workload multi_turn --host-cache-tokens 16384 \
      --kv-events --kv-events-gpu-only      # ... and + events blind to the host tier

For each policy the router restarts with it and every worker's cache is flushed, so
each policy meets the same cold fleet and the same requests in the same order. SGLang's
Rust router (`sglang-router`, in its own venv: `--sglang-python VENV/bin/python`) joins
as a peer over the same workers; its per-worker counts come from the workers' /metrics
(it names no worker in its answers). `--host-cache-tokens 0,N,...` repeats the whole
comparison on a fresh fleet for each host KV tier size (issue 22; results in
loadtests/results/host_tier.md).
Prints a line per phase with elapsed time and time left, one table (throughput, TTFT
p50/p99, hit rate, max/mean requests per worker), the cache-aware / round-robin ratios
and a one-line verdict, and saves `policies.png`.

The defaults are a fleet where routing decides the outcome, as on a real one: the
workload's prefixes (8 system prompts of ~1,000 tokens) fit in the fleet's KV caches
together but not in one worker's (4,096 tokens each: room for three), so a router that spreads every
prompt over every worker makes each worker evict what it will need next; prefill
(100 µs per uncached token) is most of a request's time to first token, as on GPUs
with long prompts; and the imbalance gap is half a worker's batch (4 of 8), the scale
at which cache-aware routing still spreads load over a 4-worker cluster
(loadtests/results/policies.md); 8 users, two per worker, so that load stays even and
the imbalance rule seldom overrides the cache (with 16 users on a loaded 2-core machine
the load reports swung, and cache-aware's hit rate varied from 0.25 to 0.54 between
runs). With a cache larger than the whole workload, or a decode-bound workload, every
policy ends up with the same hits and the comparison shows only noise. Measured with
these defaults: loadtests/results/policies.md, "The defaults".
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
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
from loadtests.load.cluster import ClusterSpec
from loadtests.load.runner import RunSpec, Summary, run


@dataclass(frozen=True)
class RouterSpec:
    policy: str
    settings: dict[str, str] = field(default_factory=dict)  # RouterConfig keys of its own


HOST_HITS = "radix_worker_cached_tokens_by_tier_total"  # the workers' hits, by tier
SGLANG = "sglang-router"  # SGLang's Rust router, cache_aware at its defaults
POLICIES: dict[str, RouterSpec] = {
    "cache_aware (fleet)": RouterSpec("cache_aware", {"balance_mode": "fleet"}),
    "cache_aware (per_request)": RouterSpec("cache_aware", {"balance_mode": "per_request"}),
    "cost_aware": RouterSpec("cost_aware"),
    "cost_aware (miss x2)": RouterSpec("cost_aware", {"cost_miss_weight": "2"}),
    # The rule before the stall and hold terms (loadtests/results/routing.md, 2026-12-01).
    "cost_aware (before)": RouterSpec(
        "cost_aware", {"cost_stall_weight": "0", "cost_hold_margin": "0"}
    ),
    "round_robin": RouterSpec("round_robin"),
    "least_load": RouterSpec("least_load"),
    "power_of_two": RouterSpec("power_of_two"),
    "random": RouterSpec("random"),
    "consistent_hash": RouterSpec("consistent_hash"),
}
DEFAULT_POLICIES = ("cache_aware (fleet)", "round_robin", "least_load")
# `--kv-events`: each policy runs twice, as listed and as "<policy> + events" (the same
# keys plus the block index fed by the workers' KV events; the sim workers' tokenizer).
EVENTS = " + events"
EVENTS_SETTINGS = {"kv_events": "true", "tokenizer": "sim"}
# `--kv-events-gpu-only`: a third arm, "<policy> + events (GPU only)": the index counts
# host-held blocks as misses (kv_events_host_weight 0), as a router reading only the
# device's events would (a demoted prefix looks gone).
EVENTS_GPU = " + events (GPU only)"
EVENTS_GPU_SETTINGS = {**EVENTS_SETTINGS, "kv_events_host_weight": "0"}
EVENTS_SETTLE_S = 1.0  # the router reads the flush's "cleared" events before traffic
# The workload defaults of `compare` (see the module docstring for why these).
WORKLOAD_DEFAULTS = {
    "groups": 8, "prompts_per_group": 16, "system_len": 512, "question_len": 24,
    "output_len": 16,
}  # fmt: skip


def router_settings(name: str, settings: dict[str, str] | None = None) -> dict[str, str]:
    """One policy's router: every router's ``settings``, then the policy's own keys,
    then the event index where the name ends in ``EVENTS`` (or ``EVENTS_GPU``)."""
    base = name.removesuffix(EVENTS_GPU)
    events = EVENTS_GPU_SETTINGS if base != name else {}
    if not events:
        base = name.removesuffix(EVENTS)
        events = EVENTS_SETTINGS if base != name else {}
    spec = POLICIES[base]
    return {**(settings or {}), "policy": spec.policy, **spec.settings, **events,
            "log_level": "WARNING"}  # fmt: skip


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
    cluster_spec: ClusterSpec,
    workload: WorkloadOptions,
    run_spec: RunSpec,
    policies: list[str],
    settings: dict[str, str] | None = None,
    sglang_python: str | None = None,
    host_tiers: tuple[int, ...] = (),
) -> dict[str, Summary]:
    """``settings``: RouterConfig keys for every router (thresholds, no_match, ...);
    a policy's own keys (balance_mode) win. ``sglang_python``: a Python with
    `sglang-router` installed; SGLang's router then runs last, as ``sglang-router``.
    ``host_tiers``: host KV tier sizes (tokens a worker); each gets a fresh fleet and
    every policy, named ``POLICY, host N`` (empty: the one fleet of ``cluster_spec``)."""
    results: dict[str, Summary] = {}
    if any(EVENTS in p for p in policies) and not cluster_spec.kv_events:
        raise ValueError("a '+ events' policy needs a fleet whose workers publish (kv_events)")
    policies = list(policies) + ([SGLANG] if sglang_python else [])
    tiers = host_tiers or (cluster_spec.host_cache_tokens,)
    progress = Progress("compare", len(tiers) * (1 + len(policies)))
    for tier in tiers:
        spec = replace(cluster_spec, host_cache_tokens=tier)
        suffix = f", host {tier}" if len(tiers) > 1 else ""
        results |= {
            f"{name}{suffix}": s
            for name, s in _one_cluster(spec, workload, run_spec, policies, settings,
                                      sglang_python, progress, suffix).items()
        }  # fmt: skip
    if sglang_python is None:
        print("no --sglang-python: SGLang's router skipped")
    return results


def _one_cluster(
    cluster_spec: ClusterSpec, workload: WorkloadOptions, run_spec: RunSpec, policies: list[str],
    settings: dict[str, str] | None, sglang_python: str | None, progress: Progress, suffix: str,
) -> dict[str, Summary]:  # fmt: skip
    results: dict[str, Summary] = {}
    tier = f", host tier {cluster_spec.host_cache_tokens} tokens" if suffix else ""
    progress.say(f"starting Redis, {cluster_spec.workers} sim workers{tier} and a router")
    with cluster_spec.start() as cluster:
        progress.finished()
        for name in policies:
            progress.say(f"{name}: restarting the router, flushing caches, running the workload")
            if name == SGLANG:
                assert sglang_python is not None
                cluster.start_sglang_router(sglang_python)
            else:
                cluster.start_router(router_settings(name, settings))
            cluster.flush()
            if cluster_spec.kv_events:  # both arms wait alike
                time.sleep(EVENTS_SETTLE_S)
            before = cluster.worker_requests()
            host_before = cluster.worker_counter(HOST_HITS, 'tier="host"')
            slug = (name + suffix).replace(" ", "_").replace(",", "")
            out = run_spec.out / slug.replace("(", "").replace(")", "")
            # Every request names the sim workers' model: SGLang's router requires one.
            run_at = RunSpec(**{**run_spec.__dict__, "host": cluster.router_url, "out": out,
                                "model": run_spec.model or "sim"})  # fmt: skip
            summary = run(run_at, workload, title=f"{workload.workload}: {name}", quiet=True)
            # Idle workers count: the records only name the workers that got requests.
            results[name] = r = summary.over_fleet(f"w{i}" for i in range(cluster_spec.workers))
            if name == SGLANG:  # it names no worker in its answers: count at the workers
                after = cluster.worker_requests()
                counts = {w: after[w] - before[w] for w in after}
                results[name] = r = replace(r, per_worker_requests=counts)
            host = cluster.worker_counter(HOST_HITS, 'tier="host"') - host_before
            if cluster_spec.host_cache_tokens:
                print(f"{name}{suffix}: {host:.0f} prompt tokens hit in the host tier")
            progress.finished(
                f"{name}{suffix}: {r.requests} requests, {r.failures} failed, "
                f"{r.throughput_rps:.1f} req/s, hit rate {r.hit_rate:.3f}"
            )
    return results


def verdict(results: dict[str, Summary]) -> str:
    ca, rr = results.get("cache_aware (fleet)"), results.get("round_robin")
    failed = sum(s.failures for s in results.values())
    if failed:
        return f"verdict: {failed} requests failed; see the table (and OUT/*/locust.log)"
    if not (ca and rr):
        return "verdict: run cache_aware (fleet) and round_robin together for a verdict"
    faster = ca.throughput_rps >= rr.throughput_rps and ca.ttft_p50_ms <= rr.ttft_p50_ms
    return (
        f"verdict: cache-aware routing {'wins' if faster else 'does not win'} here: hit rate "
        f"{ca.hit_rate:.2f} vs {rr.hit_rate:.2f}, TTFT p50 {ca.ttft_p50_ms:.0f} vs "
        f"{rr.ttft_p50_ms:.0f} ms, {ca.throughput_rps:.1f} vs {rr.throughput_rps:.1f} req/s "
        "(cache_aware vs round_robin)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--workers", type=int, default=4, help=f"sim worker processes {d}")
    p.add_argument(
        "--cache-tokens", type=int, default=4096,
        help=f"KV capacity per worker, in tokens: below the workload's prefixes together {d}",
    )  # fmt: skip
    p.add_argument(
        "--prefill-us", type=float, default=100.0,
        help=f"sim prefill cost, microseconds per uncached prompt token {d}",
    )  # fmt: skip
    p.add_argument(
        "--decode-ms", type=float, default=2.0,
        help=f"sim decode cost, milliseconds per output token {d}",
    )  # fmt: skip
    p.add_argument("--max-running", type=int, default=8, help=f"requests a worker runs at once {d}")
    p.add_argument(
        "--host-cache-tokens", default="0",
        help="host KV tier per worker, in tokens; comma-separated for one fleet each, "
        f"side by side, e.g. 0,16384,40960 {d}",
    )  # fmt: skip
    p.add_argument(
        "--policies", default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, or all, from: {', '.join(POLICIES)} {d}",
    )  # fmt: skip
    p.add_argument(
        "--router-setting", action="append", default=[], metavar="KEY=VALUE",
        help="a RouterConfig key for every router (repeatable; default: "
        "balance_abs_threshold=half of --max-running)",
    )  # fmt: skip
    p.add_argument(
        "--sglang-python", default=None,
        help="a Python with sglang-router installed (its own venv): adds SGLang's router",
    )  # fmt: skip
    p.add_argument("--users", type=int, default=8, help=f"concurrent simulated users {d}")
    p.add_argument(
        "--run-time",
        default=None,
        help="per policy, e.g. 30s (default: one pass over the workload)",
    )
    p.add_argument(
        "--max-requests", type=int, default=0, help="per policy (default: 0, the whole workload)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("loadtests/out/compare"), help=f"report folder {d}"
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="bar chart path (default: OUT/policies.png)"
    )
    p.add_argument(
        "--kv-events", action="store_true",
        help="workers publish KV events; each policy runs twice: the tree alone and "
        "'<policy> + events' (router kv_events on)",
    )  # fmt: skip
    p.add_argument(
        "--kv-events-gpu-only", action="store_true",
        help="with --kv-events, a third run per policy: '<policy> + events (GPU only)', "
        "its index blind to the workers' host tiers (kv_events_host_weight 0)",
    )  # fmt: skip
    add_workload_arguments(p, defaults=WORKLOAD_DEFAULTS)


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--router-setting wants KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def main(args: argparse.Namespace) -> int:
    names = list(POLICIES) if args.policies.strip() == "all" else args.policies.split(",")
    policies = [p.strip() for p in names if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    if args.kv_events_gpu_only and not args.kv_events:
        raise ValueError("--kv-events-gpu-only needs --kv-events")
    if args.kv_events:
        arms = (EVENTS, EVENTS_GPU) if args.kv_events_gpu_only else (EVENTS,)
        policies = [n for p in policies for n in (p, *(p + a for a in arms))]
    cluster = ClusterSpec(
        workers=args.workers, cache_tokens=args.cache_tokens, prefill_us_per_token=args.prefill_us,
        decode_ms_per_token=args.decode_ms, max_running_requests=args.max_running,
        kv_events=args.kv_events,
    )  # fmt: skip
    tiers = tuple(int(t) for t in args.host_cache_tokens.split(",") if t.strip())
    if any(t < 0 for t in tiers):
        raise ValueError(f"--host-cache-tokens must be >= 0, got {args.host_cache_tokens!r}")
    workload = options_from_namespace(args)
    run_spec = RunSpec(
        host="",
        out=args.out,
        users=args.users,
        run_time=args.run_time,
        max_requests=args.max_requests,
    )
    # The imbalance gap at half a worker's batch, as `radix-router up` sets it (the
    # router's default, 64, is for GPU workers running hundreds at once).
    settings = {"balance_abs_threshold": str(max(1, args.max_running // 2))}
    settings |= dict(_setting(s) for s in args.router_setting)
    started = time.monotonic()
    results = compare(cluster, workload, run_spec, policies, settings, args.sglang_python, tiers)
    text = table(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(
        json.dumps({k: v.to_dict() for k, v in results.items()}, indent=2) + "\n"
    )
    chart = args.plot or args.out / "policies.png"
    plot(results, chart, f"{workload.workload}, {args.workers} sim workers")
    print(f"chart: {chart}")
    print(f"{verdict(results)} ({clock_text(time.monotonic() - started)})")
    return 1 if any(s.failures for s in results.values()) else 0
