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
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from loadtests.options import WorkloadOptions
from loadtests.progress import Progress, clock_text
from loadtests.simulate.simulation import ClosedLoop, FleetSim, SimResult
from loadtests.simulate.sources import mooncake_requests
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig
from worker.backends.sim import DEFAULT_HOST_LOAD_BYTES_PER_S, DEFAULT_KV_BYTES_PER_TOKEN

HEADER = (
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


def run_one(
    workload: str, n: int, load: str, cost: CostModel, args: argparse.Namespace
) -> SimResult:
    config = RouterConfig(policy="cache_aware", tree_chars_per_token=5.0)  # type: ignore[call-arg]
    sim = FleetSim(config, n, cost, seed=0)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.workers.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    wanted = {v.strip() for v in args.variants.split(",")}
    runs = [(name, cost) for name, cost in variants(args) if name in wanted]
    progress = Progress("host-tier", len(sizes) * len(workloads) * len(loads) * len(runs))
    rows, lines = [], []
    print(HEADER)
    for workload in workloads:
        for n in sizes:
            for load in loads:
                got: dict[str, SimResult] = {}
                for name, cost in runs:
                    progress.say(f"{workload}, {n} workers, {load}: {name}")
                    r = got[name] = run_one(workload, n, load, cost, args)
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
