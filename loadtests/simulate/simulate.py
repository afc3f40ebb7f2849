"""The simulator's commands, in virtual time: `simulate` (below), `simulate-events` (EVENTS:
tree vs tree + KV events vs a ceiling in the divergence cases) and `host-tier` (HOST_TIER:
a host KV tier under the simulated workers). One set of cost-model flags serves all three
(`add_cost_arguments`).

`simulate`: how the real routing policy behaves at 8–1,000 workers.

    python -m loadtests simulate --workers 8,64,256,1000 --policies cache_aware,round_robin,least_load \\
        --workload mooncake --block-words 16 --max-output 64 --out loadtests/out/sim

Each (fleet size, policy) replays the workload through `router.policy` + `router.holdings.tree`
against simulated workers (the real RadixCache, the sim engine's cost model; see
loadtests/simulate/). Mooncake: one trace copy per `--workers-per-copy` workers, each in its
own block namespace, and the arrival rate scaled so that every fleet size sees the same
requests per second per worker. A threshold sweep (`--sweep-at N`) runs cache_aware
over `--thresholds` × `--balance-abs` at one fleet size: how users tune the router
before deploying. `--kv-arms` runs cache_aware / cost_aware once per arm: the tree alone,
tree + the workers' KV events, or the ceiling (loadtests/simulate/divergence.py; the
divergence cases themselves: EVENTS below). Prints the tables;
writes `simulation.json` and PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np

from loadtests.kit import (
    Command,
    Progress,
    WorkloadOptions,
    add_workload_arguments,
    clock_text,
    options_from_namespace,
)
from loadtests.load.compare import POLICIES, RouterSpec
from loadtests.simulate.divergence import ARMS, CASES, ArmSpec, Case, DivergenceSim
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


def pyplot() -> ModuleType:
    """matplotlib's pyplot, headless, imported when `simulate` plots: simulate-events and
    host-tier run without the `loadtest` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def plot_scale(results: dict[tuple[int, str], SimResult], path: Path) -> None:
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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


def add_cost_arguments(p: argparse.ArgumentParser, cache_tokens: int, host: bool) -> None:
    """The cost model's flags (worker/backends/sim.py's knobs), the same for every command
    here; `host`: also what a host-tier load costs (`cost_model` reads them)."""
    p.add_argument(
        "--cache-tokens", type=int, default=cache_tokens,
        help="device KV capacity per worker, in tokens",
    )  # fmt: skip
    p.add_argument(
        "--prefill-us", type=float, default=30.0, help="prefill cost, µs per uncached token"
    )
    p.add_argument("--decode-ms", type=float, default=3.0, help="decode cost, ms per output token")
    p.add_argument("--max-running", type=int, default=8, help="requests a worker runs at once")
    if host:
        p.add_argument(
            "--host-load-gbps", type=float, default=DEFAULT_HOST_LOAD_BYTES_PER_S / 1e9,
            help="host -> device KV bandwidth, GB/s",
        )  # fmt: skip
        p.add_argument(
            "--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
            help="KV bytes of one token (the model's layers x KV heads x head dim x 2 x dtype)",
        )  # fmt: skip


def cost_model(args: argparse.Namespace, host_cache_tokens: int) -> CostModel:
    """The flags of `add_cost_arguments(..., host=True)` and a host tier of this size."""
    if host_cache_tokens < 0:
        raise SystemExit(f"--host-cache-tokens must be >= 0, got {host_cache_tokens}")
    if args.host_load_gbps <= 0 or args.kv_bytes_per_token <= 0:
        raise SystemExit("--host-load-gbps and --kv-bytes-per-token must be positive")
    return CostModel(
        args.prefill_us, args.decode_ms, args.max_running, args.cache_tokens,
        host_cache_tokens=host_cache_tokens,
        host_load_bytes_per_s=args.host_load_gbps * 1e9,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64", help="fleet sizes to simulate, comma-separated")
    p.add_argument(
        "--policies", default="cache_aware,round_robin,least_load",
        help="comma-separated: policy names, or compare's variants (e.g. 'cost_aware (before)')",
    )  # fmt: skip
    add_cost_arguments(p, cache_tokens=16_384, host=True)
    p.add_argument(
        "--host-cache-tokens", type=int, default=0,
        help="host KV tier per worker, in tokens (0: off); a load costs its bytes over "
        "--host-load-gbps",
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


def main(args: argparse.Namespace) -> int:
    o = options_from_namespace(args)
    cost = cost_model(args, args.host_cache_tokens)
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


# -- simulate-events ---------------------------------------------------------------------
WORKLOAD = {"workload": "multi_turn", "system_len": 256, "question_len": 64,
            "output_len": 128, "turns": 4}  # fmt: skip

EVENTS_COLUMNS = (
    "| workers | case | arm | requests | hit rate | vs tree (pts) | TTFT p50 / p99 (ms) | "
    "best holder | decisions |\n|---:|---|---|---:|---:|---:|---:|---:|---|"
)


def chars_per_token(o: WorkloadOptions) -> float:
    """The workload's own chars per token (the sim tokenizer: one id per word): the tree's
    tuned `tree_chars_per_token`."""
    from loadtests.load.workloads import Workload

    text = Workload(dataclasses.replace(o, conversations=4)).new_session().next_request()
    s = text.text() if text is not None else "a b"
    return len(s) / len(s.split())


def events_run(
    config: RouterConfig, n: int, cost: CostModel, o: WorkloadOptions, case: Case,
    spec: ArmSpec, args: argparse.Namespace,
) -> dict[str, object]:  # fmt: skip
    conversations = n * (args.conversations_per_worker or args.users_per_worker)
    o = dataclasses.replace(o, conversations=conversations)
    routed = conversations * o.turns - (conversations if case.direct else 0)
    sim = DivergenceSim(
        config, n, cost, case, spec, routed // 2, seed=args.sim_seed, think_s=args.think_s,
        reply_hits=args.reply_hits,
    )  # fmt: skip
    sim.run(closed=ClosedLoop(o, users=args.users_per_worker * n))
    return {"workers": n, "case": case.name, "arm": spec.arm, **sim.summary()}


def events_row(r: dict[str, object], tree: float | None) -> str:
    delta = "" if tree is None else f"{(float(r['hit_rate']) - tree) * 100:+.1f}"  # type: ignore[arg-type]
    best = r.get("best_holder_rate")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))  # type: ignore[union-attr]
    return (
        f"| {r['workers']} | {r['case']} | {r['arm']} | {r['requests']} | {r['hit_rate']:.3f} | "
        f"{delta} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
        f"{'' if best is None else f'{best:.3f}'} | {reasons} |"
    )


def events_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64", help="fleet sizes, comma-separated")
    p.add_argument("--cases", default=",".join(CASES), help=f"of: {', '.join(CASES)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"of: {', '.join(ARMS)}")
    p.add_argument("--policy", default="cache_aware", choices=("cache_aware", "cost_aware"))
    p.add_argument(
        "--event-delay-ms", type=float, default=50.0,
        help="virtual ms from a step's end to the router's index (publisher interval + poll)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, help="tokens per event block")
    p.add_argument(
        "--kv-inflight", type=float,
        default=RouterConfig.model_fields["kv_events_inflight"].default,
        help="events arm: seconds a routed request's tree entry still counts (kv_events_inflight)",
    )  # fmt: skip
    p.add_argument(
        "--tree-chars-per-token", type=float, default=0.0,
        help="the tree arm's chars per token (0: the workload's own, i.e. tuned; the "
        "product default is 4.0)",
    )  # fmt: skip
    p.add_argument(
        "--balance-abs", type=int, default=4,
        help="balance_abs_threshold (4, as the live bench; at the product default 64 every "
        "conversation piles on the first holder of the shared system prompt)",
    )  # fmt: skip
    add_cost_arguments(p, cache_tokens=16_384, host=False)
    p.add_argument("--users-per-worker", type=int, default=4, help="closed-loop users")
    p.add_argument(
        "--conversations-per-worker", type=int, default=0,
        help="0: one per user, so every conversation is halfway when the case diverges",
    )  # fmt: skip
    p.add_argument(
        "--think-s", type=float, default=1.0,
        help="mean think time before each turn (exponential, seeded per conversation and turn)",
    )  # fmt: skip
    p.add_argument(
        "--reply-hits", action="store_true",
        help="a reply's cached ids equal its ids in the next turn (a round-tripping chat "
        "template); default: replies never hit",
    )  # fmt: skip
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    add_workload_arguments(p, defaults=WORKLOAD)


def events_main(args: argparse.Namespace) -> int:
    o = options_from_namespace(args)
    if o.workload != "multi_turn":
        raise SystemExit("simulate-events runs conversations: --workload multi_turn")
    sizes = [int(x) for x in args.workers.split(",")]
    cases = [CASES[c.strip()] for c in args.cases.split(",") if c.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    cost = CostModel(args.prefill_us, args.decode_ms, args.max_running, args.cache_tokens)
    cpt = args.tree_chars_per_token or round(chars_per_token(o), 2)
    config = RouterConfig(
        policy=args.policy, balance_abs_threshold=args.balance_abs, tree_chars_per_token=cpt,
        kv_events_inflight=args.kv_inflight,
    )  # fmt: skip
    print(
        f"tree_chars_per_token {cpt}, event delay {args.event_delay_ms} ms, block "
        f"{args.block_size}, kv_events_inflight {args.kv_inflight} s"
    )
    progress = Progress("simulate-events", len(sizes) * len(cases) * len(arms))
    rows: list[dict[str, object]] = []
    print(EVENTS_COLUMNS)
    for n in sizes:
        for case in cases:
            tree: float | None = None
            for arm in arms:
                progress.say(f"{n} workers, {case.name}, {arm}")
                spec = ArmSpec(arm, args.event_delay_ms / 1e3, args.block_size)
                r = events_run(config, n, cost, o, case, spec, args)
                rows.append(r)
                progress.finished()
                print(events_row(r, tree), flush=True)
                if arm == "tree":
                    tree = float(r["hit_rate"])  # type: ignore[arg-type]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"done ({clock_text(progress.elapsed)})")
    return 0


EVENTS = Command(
    """Tree alone vs tree + KV events vs a ceiling, in the simulator: the divergence cases.

    python -m loadtests simulate-events --workers 8,64 \\
        --cases baseline,direct,flush,flush_half,restart,capacities --arms tree,events,ceiling

Each (fleet size, case) runs the same conversations (`multi_turn`: one shared system
prompt, then each conversation's own turns; closed loop, `--users-per-worker` users,
`--conversations-per-worker` conversations) once per arm (loadtests/simulate/divergence.py):
the real `cache_aware` / `cost_aware` policy, its real tree and, for `events`, the real
`KvEventFeed` / `BlockIndex` / `KvScorer` fed by the workers' own radix-cache events after
`--event-delay-ms` of virtual time. `ceiling` is the same policy reading every worker's
actual cache at each decision: what any router that follows these rules could know. Its
`best holder` column is the share of prompt tokens the best-matching worker held at each
decision, whatever its load: a bound on what routing on the past can reach (in-flight
sharing can add to it). Virtual time: deterministic for a seed. Prints one table.
""",
    events_arguments,
    events_main,
)


# -- host-tier ---------------------------------------------------------------------------
HOST_TIER_HEADER = (
    "| workload | workers | load | variant | requests | busy | hit rate | of it from host | "
    "TTFT p50 / p99 (ms) | preemptions |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|"
)


def variants(args: argparse.Namespace) -> list[tuple[str, CostModel]]:
    base = cost_model(args, host_cache_tokens=0)
    c = args.cache_tokens
    return [
        ("no tier", base),
        ("host 4x", replace(base, host_cache_tokens=4 * c)),
        ("host 10x", replace(base, host_cache_tokens=10 * c)),
        ("unbounded", replace(base, cache_tokens=args.unbounded_tokens)),
    ]


def host_tier_run(
    workload: str, n: int, load: str, cost: CostModel, args: argparse.Namespace
) -> SimResult:
    config = RouterConfig(policy="cache_aware", tree_chars_per_token=5.0)  # type: ignore[call-arg]
    sim = Simulation(config, n, cost, seed=0)
    if workload == "mooncake":
        speedup = args.light_speedup if load == "light" else args.busy_speedup
        o = WorkloadOptions(
            workload="mooncake", block_words=args.block_words, max_output=args.max_output,
            trace_limit=args.trace_limit,
        )  # fmt: skip
        copies = max(1, math.ceil(n / args.workers_per_copy))
        per_worker = speedup * n / (copies * args.workers_per_copy)
        sim.run(source=mooncake_requests(o, n, args.workers_per_copy, per_worker, 0))
    else:
        think = args.light_think_s if load == "light" else args.busy_think_s
        o = WorkloadOptions(
            workload="multi_turn", conversations=args.conversations_per_worker * n,
            turns=args.turns, system_len=args.system_len, question_len=args.question_len,
            output_len=args.output_len,
        )  # fmt: skip
        sim.run(closed=ClosedLoop(o, users=args.users_per_worker * n, think_s=think))
    return sim.result("cache_aware", measure_memory=False)


def host_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="mooncake,multi_turn")
    p.add_argument("--workers", default="32,256", help="fleet sizes, comma-separated")
    p.add_argument("--loads", default="light,busy")
    add_cost_arguments(p, cache_tokens=4096, host=True)
    p.add_argument("--unbounded-tokens", type=int, default=1 << 18, help="'unbounded' device KV")
    p.add_argument("--block-words", type=int, default=16, help="mooncake: tokens a block")
    p.add_argument("--max-output", type=int, default=64, help="mooncake: output cap")
    p.add_argument("--workers-per-copy", type=int, default=32, help="mooncake: trace copies")
    p.add_argument("--trace-limit", type=int, default=None, help="mooncake: first N lines")
    p.add_argument("--light-speedup", type=float, default=10.0, help="mooncake, light")
    p.add_argument("--busy-speedup", type=float, default=80.0, help="mooncake, busy")
    p.add_argument("--users-per-worker", type=int, default=8, help="multi_turn")
    p.add_argument("--conversations-per-worker", type=int, default=24, help="multi_turn")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--light-think-s", type=float, default=10.0, help="multi_turn, light")
    p.add_argument("--busy-think-s", type=float, default=0.5, help="multi_turn, busy")
    p.add_argument("--variants", default="no tier,host 4x,host 10x,unbounded")
    p.add_argument("--out", type=Path, default=Path("loadtests/out/host_tier"))


def host_tier_main(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.workers.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    wanted = {v.strip() for v in args.variants.split(",")}
    runs = [(name, cost) for name, cost in variants(args) if name in wanted]
    progress = Progress("host-tier", len(sizes) * len(workloads) * len(loads) * len(runs))
    rows, lines = [], []
    print(HOST_TIER_HEADER)
    for workload in workloads:
        for n in sizes:
            for load in loads:
                got: dict[str, SimResult] = {}
                for name, cost in runs:
                    progress.say(f"{workload}, {n} workers, {load}: {name}")
                    r = got[name] = host_tier_run(workload, n, load, cost, args)
                    progress.finished()
                    d = r.row()
                    host_share = r.host_cached_tokens / r.cached_tokens if r.cached_tokens else 0
                    print(
                        f"| {workload} | {n} | {load} | {name} | {r.requests} | {r.busy:.2f} | "
                        f"{r.hit_rate:.3f} | {host_share:.2f} | {d['ttft_p50_ms']:.1f} / "
                        f"{d['ttft_p99_ms']:.1f} | {r.preemptions} |",
                        flush=True,
                    )
                    rows.append({"workload": workload, "workers": n, "load": load,
                                 "variant": name, **d, "hit_rate": r.hit_rate})  # fmt: skip
                if not {"host 4x", "no tier", "unbounded"} <= got.keys():
                    continue
                tier, none, top = got["host 4x"], got["no tier"], got["unbounded"]
                p99 = tier.row()["ttft_p99_ms"] / none.row()["ttft_p99_ms"]  # type: ignore[operator]
                lines.append(
                    f"{workload}, {n} workers, {load} (no-tier busy {none.busy:.2f}): "
                    f"hit host 4x / unbounded {tier.hit_rate / top.hit_rate:.3f} "
                    f"(target >= 0.97), TTFT p99 host 4x / no tier {p99:.2f}"
                    + (" (target <= 0.8)" if load == "busy" else "")
                )
    print("\n" + "\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_tier.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"done ({clock_text(progress.elapsed)})")
    return 0


HOST_TIER = Command(
    """What a host KV tier buys a fleet: the simulator, side by side in one run.

    python -m loadtests host-tier --workloads mooncake,multi_turn --workers 32,256

For each workload, fleet size and load, the same requests go through the real router
policy (cache_aware; its tree cap follows device + host capacity) to simulated workers
(the real engine over the cost model, loadtests/simulate/) four times:

    no tier       device pool of --cache-tokens, nothing below it
    host 4x       the same device pool + a host tier of 4x its size
    host 10x      ... of 10x its size
    unbounded     a device pool of --unbounded-tokens (nothing is ever evicted)

A host hit costs its load (`--kv-bytes-per-token` / `--host-load-gbps`), a miss its
prefill (`--prefill-us` a token). Loads: `light` and `busy` (mooncake: the replay
speedup; multi_turn: closed-loop users' think time), each given on the command line;
`busy` is meant to be ~80% busy and the table prints the measured busy fraction of
the no-tier fleet (step time / (workers x span)). Prints one table and the two target
ratios: hit(host 4x) / hit(unbounded), and TTFT p99(host 4x) / p99(no tier) when busy.
""",
    host_tier_arguments,
    host_tier_main,
)
