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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from loadtests.options import WorkloadOptions, add_workload_arguments, options_from_namespace
from loadtests.progress import Progress, clock_text
from loadtests.simulate.divergence import ARMS, CASES, ArmSpec, Case, DivergenceSim
from loadtests.simulate.simulation import ClosedLoop
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig

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
