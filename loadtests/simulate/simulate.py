"""Fleet simulation in virtual time: how the real routing policy behaves at 8–1,000 workers.

    python -m loadtests simulate --workers 8,64,256,1000 --policies cache_aware,round_robin,least_load \\
        --workload mooncake --block-words 16 --max-output 64 --out loadtests/out/sim

Each (fleet size, policy) replays the workload through `router.policy` + `router.policy.tree`
against simulated workers (the real RadixCache, the sim engine's cost model; see
loadtests/simulate/). Mooncake: one trace copy per `--workers-per-copy` workers, each in its
own block namespace, and the arrival rate scaled so that every fleet size sees the same
requests per second per worker. A threshold sweep (`--sweep-at N`) runs cache_aware
over `--thresholds` × `--balance-abs` at one fleet size: how users tune the router
before deploying. `--kv-arms` runs cache_aware / cost_aware once per arm: the tree alone,
tree + the workers' KV events, or the ceiling (loadtests/simulate/divergence.py; the
divergence cases themselves: `python -m loadtests simulate-events`). Prints the tables;
writes `simulation.json` and PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from loadtests.kit import (
    Progress,
    WorkloadOptions,
    add_workload_arguments,
    clock_text,
    options_from_namespace,
)
from loadtests.load.compare import POLICIES, RouterSpec
from loadtests.simulate.divergence import ARMS, CASES, ArmSpec, DivergenceSim
from loadtests.simulate.simulation import (
    ClosedLoop,
    SimResult,
    Simulation,
    generated_requests,
    mooncake_requests,
)
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig
from worker.backends.sim import DEFAULT_HOST_LOAD_BYTES_PER_S, DEFAULT_KV_BYTES_PER_TOKEN

COLUMNS = (
    "| workers | policy | requests | req/s | hit rate | TTFT p50 / p99 (ms) | queue p99 (ms) | "
    "max/mean requests per worker | decision CPU µs mean / p99 | sim CPU µs / request | "
    "policy memory (MB) |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


SWEEP_KEYS = ("cache_threshold", "balance_abs_threshold", "no_match", "balance_mode")


def simulate_one(
    config: RouterConfig, n: int, cost: CostModel, o: WorkloadOptions, args: argparse.Namespace,
    arm: str | None = None,
) -> SimResult:  # fmt: skip
    if arm is None:
        sim = Simulation(config, n, cost, seed=args.sim_seed)
    else:  # tree alone / tree + KV events / the ceiling (loadtests/simulate/divergence.py)
        spec = ArmSpec(arm, args.event_delay_ms / 1e3, args.event_block_size)
        sim = DivergenceSim(config, n, cost, CASES["baseline"], spec, 1 << 62, args.sim_seed)
    if o.workload == "mooncake":
        copies = max(1, math.ceil(n / args.workers_per_copy))
        # Same requests per second per worker at every fleet size.
        speedup = o.speedup * n / (copies * args.workers_per_copy)
        sim.run(source=mooncake_requests(o, n, args.workers_per_copy, speedup, args.sim_seed))
    elif o.workload == "multi_turn" or args.closed:
        sim.run(closed=ClosedLoop(o, users=args.users_per_worker * n))
    else:
        sim.run(source=generated_requests(o, args.rate_per_worker * n, args.sim_seed))
    return sim.result(config.policy, measure_memory=not args.no_memory)


def row(r: SimResult, name: str) -> str:
    d = r.row()
    return (
        f"| {r.workers} | {name} | {r.requests} | {d['throughput_rps']:.0f} | {r.hit_rate:.3f} | "
        f"{d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f} | {d['queue_p99_ms']:.1f} | "
        f"{r.load_max_over_mean:.2f} | {d['decision_us_mean']:.1f} / {d['decision_us_p99']:.1f} | "
        f"{r.sim_us_per_request:.0f} | {d['policy_mb']:.2f} |"
    )


def plot_scale(results: dict[tuple[int, str], SimResult], path: Path) -> None:
    policies = sorted({p for _, p in results})
    sizes = sorted({n for n, _ in results})
    panels = [
        ("hit rate", lambda r: r.hit_rate),
        ("TTFT p99 (ms)", lambda r: r.pct(r.ttft, 99) * 1e3),
        ("max/mean requests per worker", lambda r: r.load_max_over_mean),
        ("router CPU µs per decision (mean)", lambda r: float(r.decision_us.mean())),
        ("policy memory (MB)", lambda r: r.policy_bytes / 2**20),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.3))
    for ax, (title, f) in zip(axes, panels, strict=True):
        for p in policies:
            ax.plot(sizes, [f(results[(n, p)]) for n in sizes], marker="o", label=p)
        ax.set_xscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set(title=title, xlabel="workers")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_ttft_cdf(results: dict[tuple[int, str], SimResult], n: int, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.3))
    for (size, p), r in sorted(results.items()):
        if size == n and len(r.ttft):
            xs = np.sort(r.ttft * 1e3)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=p)
    ax.set(
        xscale="log",
        xlabel="TTFT (ms, virtual)",
        ylabel="fraction ≤ x",
        title=f"TTFT CDF, {n} workers",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_sweep(sweep: dict[tuple[float, int, str, str], SimResult], path: Path) -> None:
    thresholds = sorted({k[0] for k in sweep})
    lines = sorted({k[1:] for k in sweep})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    panels = [
        ("hit rate", lambda r: r.hit_rate),
        ("TTFT p99 (ms)", lambda r: r.pct(r.ttft, 99) * 1e3),
        ("max/mean requests per worker", lambda r: r.load_max_over_mean),
    ]
    for ax, (title, f) in zip(axes, panels, strict=True):
        for a, m, mode in lines:
            ys = [f(sweep[(t, a, m, mode)]) for t in thresholds]
            ax.plot(thresholds, ys, marker="o", label=f"abs {a}, {m}, {mode}")
        ax.set(xlabel="cache_threshold", title=title)
    axes[0].legend(fontsize=6, title="balance_abs / no_match / mode", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64", help="fleet sizes to simulate, comma-separated")
    p.add_argument(
        "--policies", default="cache_aware,round_robin,least_load",
        help="comma-separated: policy names, or compare's variants (e.g. 'cost_aware (before)')",
    )  # fmt: skip
    p.add_argument(
        "--cache-tokens", type=int, default=16_384, help="KV capacity per worker, in tokens"
    )
    p.add_argument(
        "--prefill-us", type=float, default=30.0, help="prefill cost, µs per uncached token"
    )
    p.add_argument("--decode-ms", type=float, default=3.0, help="decode cost, ms per output token")
    p.add_argument("--max-running", type=int, default=8, help="requests a worker runs at once")
    p.add_argument(
        "--host-cache-tokens", type=int, default=0,
        help="host KV tier per worker, in tokens (0: off); a load costs its bytes over "
        "--host-load-gbps",
    )  # fmt: skip
    p.add_argument(
        "--host-load-gbps", type=float, default=DEFAULT_HOST_LOAD_BYTES_PER_S / 1e9,
        help="host -> device KV bandwidth, GB/s",
    )  # fmt: skip
    p.add_argument(
        "--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
        help="KV bytes of one token (the model's layers x KV heads x head dim x 2 x dtype)",
    )  # fmt: skip
    p.add_argument(
        "--workers-per-copy", type=int, default=8, help="mooncake: workers per trace copy"
    )
    p.add_argument(
        "--rate-per-worker", type=float, default=4.0, help="shared_prefix/rag: req/s per worker"
    )
    p.add_argument(
        "--users-per-worker", type=int, default=4,
        help="multi_turn and --closed: closed-loop users per worker",
    )  # fmt: skip
    p.add_argument(
        "--closed", action="store_true",
        help="shared_prefix/rag: closed-loop users (each sends its next request when the "
        "last one finished, as the live locust users do) instead of Poisson arrivals",
    )  # fmt: skip
    p.add_argument(
        "--cache-threshold", type=float, default=0.3, help="cache_aware: match rate to follow"
    )
    p.add_argument("--balance-abs", default="64", help="balance_abs_threshold (sweep: several)")
    p.add_argument(
        "--balance-rel", type=float, default=1.5, help="balance_rel_threshold (max/min load)"
    )
    p.add_argument(
        "--balance-mode", default="fleet", help="fleet or per_request; a comma list sweeps both"
    )
    p.add_argument(
        "--no-match",
        default=RouterConfig.model_fields["no_match"].default,
        help="no_match rule; a comma list sweeps it too (with --sweep-at)",
    )
    p.add_argument(
        "--sweep-at", type=int, default=0, help="fleet size of the threshold sweep (0: none)"
    )
    p.add_argument("--thresholds", default="0.1,0.3,0.5,0.7", help="sweep: cache_threshold values")
    p.add_argument(
        "--kv-arms", default="",
        help=f"cache_aware/cost_aware once per arm (of: {', '.join(ARMS)}): tree alone, "
        "tree + KV events, the ceiling (loadtests/simulate/divergence.py); empty: as before",
    )  # fmt: skip
    p.add_argument(
        "--event-delay-ms", type=float, default=50.0,
        help="--kv-arms events: virtual ms from a step's end to the router's index",
    )  # fmt: skip
    p.add_argument("--event-block-size", type=int, default=16, help="tokens per event block")
    p.add_argument("--sim-seed", type=int, default=0, help="seed of the simulation's tie-breaks")
    p.add_argument("--no-memory", action="store_true", help="skip measuring policy memory")
    p.add_argument(
        "--out", type=Path, default=Path("loadtests/out/sim"), help="folder for simulation.json"
    )
    p.add_argument("--plots", type=Path, default=None, help="folder for PNGs (default: OUT)")
    add_workload_arguments(p)


def cost_model(args: argparse.Namespace) -> CostModel:
    if args.host_cache_tokens < 0:
        raise SystemExit(f"--host-cache-tokens must be >= 0, got {args.host_cache_tokens}")
    if args.host_load_gbps <= 0 or args.kv_bytes_per_token <= 0:
        raise SystemExit("--host-load-gbps and --kv-bytes-per-token must be positive")
    return CostModel(
        args.prefill_us, args.decode_ms, args.max_running, args.cache_tokens,
        host_cache_tokens=args.host_cache_tokens,
        host_load_bytes_per_s=args.host_load_gbps * 1e9,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    o = options_from_namespace(args)
    cost = cost_model(args)
    sizes = [int(x) for x in args.workers.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    absolutes = [int(x) for x in _floats(args.balance_abs)]
    no_matches = [x.strip() for x in args.no_match.split(",") if x.strip()]
    modes = [x.strip() for x in args.balance_mode.split(",") if x.strip()]
    base = {
        "cache_threshold": args.cache_threshold, "balance_abs_threshold": absolutes[0],
        "balance_rel_threshold": args.balance_rel, "balance_mode": modes[0],
        "no_match": no_matches[0],
        "tree_chars_per_token": 5.0,  # the generated words: 4 letters + a space per token
    }  # fmt: skip
    out, plots = args.out, args.plots or args.out
    out.mkdir(parents=True, exist_ok=True)
    plots.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, str], SimResult] = {}
    sweep_runs = len(_floats(args.thresholds)) * len(absolutes) * len(no_matches) * len(modes)
    arms = [a.strip() for a in args.kv_arms.split(",") if a.strip()]
    scored = ("cache_aware", "cost_aware")
    runs = [(p, a) for p in policies for a in (arms if arms and p in scored else [None])]
    progress = Progress("simulate", len(sizes) * len(runs) + (sweep_runs if args.sweep_at else 0))
    print(COLUMNS)
    for n in sizes:
        for p, arm in runs:
            name = p if arm is None else f"{p} [{arm}]"
            progress.say(f"{n} workers, {name}: simulating")
            spec = POLICIES.get(p, RouterSpec(p))
            config = RouterConfig(policy=spec.policy, **{**base, **spec.settings})  # type: ignore[arg-type]
            r = simulate_one(config, n, cost, o, args, arm)
            results[(n, name)] = r
            progress.finished()
            print(row(r, name), flush=True)
    for n in sizes:
        ca, rr = results.get((n, "cache_aware")), results.get((n, "round_robin"))
        if ca and rr and rr.hit_rate:
            print(
                f"{n} workers: cache_aware / round_robin hit rate {ca.hit_rate / rr.hit_rate:.2f}x"
            )
    sweep: dict[tuple[float, int, str, str], SimResult] = {}
    if args.sweep_at:
        print(
            f"\nthreshold sweep, cache_aware, {args.sweep_at} workers\n"
            + COLUMNS.replace("| policy |", "| cache_threshold / balance_abs / no_match / mode |")
        )
        grid = [
            (th, a, m, mode)
            for th in _floats(args.thresholds)
            for a in absolutes
            for m in no_matches
            for mode in modes
        ]
        for th, a, m, mode in grid:
            keys = {"cache_threshold": th, "balance_abs_threshold": a, "no_match": m,
                    "balance_mode": mode}  # fmt: skip
            cfg = RouterConfig(policy="cache_aware", **{**base, **keys})  # type: ignore[arg-type]
            progress.say(f"sweep at {args.sweep_at} workers: {th} / {a} / {m} / {mode}")
            sweep[(th, a, m, mode)] = r = simulate_one(cfg, args.sweep_at, cost, o, args)
            progress.finished()
            print(row(r, f"{th} / {a} / {m} / {mode}"), flush=True)
        plot_sweep(sweep, plots / "sim_thresholds.png")
    plot_scale(results, plots / "sim_scale.png")
    plot_ttft_cdf(results, max(sizes), plots / "sim_ttft_cdf.png")
    dump = {
        "scale": [{**results[k].row(), "policy": k[1]} for k in results],
        "sweep": [{**v.row(), **dict(zip(SWEEP_KEYS, k, strict=True))} for k, v in sweep.items()],
    }
    (out / "simulation.json").write_text(json.dumps(dump, indent=2) + "\n")
    print(f"plots: {plots}")
    print(f"{verdict(results)} ({clock_text(progress.elapsed)})")
    return 0


def verdict(results: dict[tuple[int, str], SimResult]) -> str:
    parts = []
    for n in sorted({n for n, _ in results}):
        ca, rr = results.get((n, "cache_aware")), results.get((n, "round_robin"))
        if ca and rr:
            a, b = ca.row(), rr.row()
            parts.append(
                f"{n} workers: hit rate {ca.hit_rate:.2f} vs {rr.hit_rate:.2f}, "
                f"TTFT p50 {a['ttft_p50_ms']:.0f} vs {b['ttft_p50_ms']:.0f} ms"
            )
    if not parts:
        return "verdict: simulate cache_aware and round_robin together for a verdict"
    return "verdict (cache_aware vs round_robin): " + "; ".join(parts)
