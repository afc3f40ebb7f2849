"""Tree alone vs tree + KV events vs a ceiling, in the simulator: the divergence cases (and
`host-tier`, HOST_TIER below: a host KV tier under the simulated workers).

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path

from loadtests.kit import (
    Command,
    Progress,
    WorkloadOptions,
    add_workload_arguments,
    clock_text,
    options_from_namespace,
)
from loadtests.simulate.divergence import ARMS, CASES, ArmSpec, Case, DivergenceSim
from loadtests.simulate.simulation import ClosedLoop, SimResult, Simulation, mooncake_requests
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig
from worker.backends.sim import DEFAULT_HOST_LOAD_BYTES_PER_S, DEFAULT_KV_BYTES_PER_TOKEN

WORKLOAD = {"workload": "multi_turn", "system_len": 256, "question_len": 64,
            "output_len": 128, "turns": 4}  # fmt: skip

COLUMNS = (
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


def run_one(
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


def row(r: dict[str, object], tree: float | None) -> str:
    delta = "" if tree is None else f"{(float(r['hit_rate']) - tree) * 100:+.1f}"  # type: ignore[arg-type]
    best = r.get("best_holder_rate")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))  # type: ignore[union-attr]
    return (
        f"| {r['workers']} | {r['case']} | {r['arm']} | {r['requests']} | {r['hit_rate']:.3f} | "
        f"{delta} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
        f"{'' if best is None else f'{best:.3f}'} | {reasons} |"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--cache-tokens", type=int, default=16_384, help="KV tokens per worker")
    p.add_argument("--prefill-us", type=float, default=30.0, help="µs per uncached token")
    p.add_argument("--decode-ms", type=float, default=3.0, help="ms per output token")
    p.add_argument("--max-running", type=int, default=8, help="requests a worker runs at once")
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


def main(args: argparse.Namespace) -> int:
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
    print(COLUMNS)
    for n in sizes:
        for case in cases:
            tree: float | None = None
            for arm in arms:
                progress.say(f"{n} workers, {case.name}, {arm}")
                spec = ArmSpec(arm, args.event_delay_ms / 1e3, args.block_size)
                r = run_one(config, n, cost, o, case, spec, args)
                rows.append(r)
                progress.finished()
                print(row(r, tree), flush=True)
                if arm == "tree":
                    tree = float(r["hit_rate"])  # type: ignore[arg-type]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"done ({clock_text(progress.elapsed)})")
    return 0


# -- host-tier ---------------------------------------------------------------------------
HOST_TIER_HEADER = (
    "| workload | workers | load | variant | requests | busy | hit rate | of it from host | "
    "TTFT p50 / p99 (ms) | preemptions |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|"
)


def variants(args: argparse.Namespace) -> list[tuple[str, CostModel]]:
    base = CostModel(
        args.prefill_us, args.decode_ms, args.max_running, args.cache_tokens,
        host_load_bytes_per_s=args.host_load_gbps * 1e9,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )  # fmt: skip
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
    p.add_argument("--cache-tokens", type=int, default=4096, help="device KV per worker")
    p.add_argument("--unbounded-tokens", type=int, default=1 << 18, help="'unbounded' device KV")
    p.add_argument("--prefill-us", type=float, default=30.0)
    p.add_argument("--decode-ms", type=float, default=3.0)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--host-load-gbps", type=float, default=DEFAULT_HOST_LOAD_BYTES_PER_S / 1e9)
    p.add_argument("--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN)
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
