"""`python -m loadtests agent`: the agent workload, side by side, in one run.

Sides (the same sessions, the same fleet, the same background traffic):

  today        cache_aware; no prompt_cache_key; the engine without pins (what main
               runs: with no key the router takes today's path, with pin_budget 0 the
               engine builds no pin table)
  keys         + prompt_cache_key sessions (router/fleet/sessions.py)
  keys+pins    + pins across tool gaps (worker/engine/pins.py): `--pin-budget`, a TTL
               of `--pin-ttl-s` (virtual seconds, after `--speedup`)
  2 replicas   keys+pins through two router replicas, calls round robin, decisions
               shared `--sync-delay-s` later

and the background (shared-prefix, `--background-rate` a second) alone, to compare its
hit rate beside agents with its hit rate alone. Simulated (loadtests/simulate/agents.py:
the router's policy and session code, the engine's scheduler, cache and pins, virtual
time); `--live` replays the same sessions through a local sim fleet instead
(loadtests/load/agent_live.py), `--before-ref REF` running the today side from REF.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import replace

from loadtests.load.agents import AgentOptions
from loadtests.simulate.agents import AgentResult, background_requests, simulate_agents
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = AgentOptions(speedup=10.0, pin_ttl_s=0.0)
    for f in dataclasses.fields(AgentOptions):
        if f.name in ("keys", "pin_ttl_s"):
            continue  # set per side
        value = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=64_000, help="device KV per worker")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--prefill-us", type=float, default=30.0)
    p.add_argument("--decode-ms", type=float, default=3.0)
    p.add_argument("--pin-budget", type=float, default=0.8, help="fraction of KV, keys+pins")
    p.add_argument("--pin-ttl-s", type=float, default=None, help="default: gap max / speedup")
    p.add_argument("--background-rate", type=float, default=6.0, help="shared-prefix req/s")
    p.add_argument("--background-s", type=float, default=60.0, help="its span, seconds")
    p.add_argument(
        "--background-groups", type=int, default=8,
        help="its system prompts (as many as requests: nothing shared, churn only)",
    )  # fmt: skip
    p.add_argument("--sync-delay-s", type=float, default=0.02)
    p.add_argument("--json", default=None, help="write every row here too")
    p.add_argument("--live", action="store_true", help="through a local sim fleet")
    p.add_argument("--before-ref", default=None, help="--live: the today side from this ref")


def _options(args: argparse.Namespace) -> AgentOptions:
    names = {f.name for f in dataclasses.fields(AgentOptions)}
    return AgentOptions(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def run_sides(args: argparse.Namespace) -> tuple[list[AgentResult], dict[str, float]]:
    o = replace(_options(args), keys=False, pin_ttl_s=0.0)
    ttl = args.pin_ttl_s if args.pin_ttl_s is not None else o.gap_max_s / o.speedup
    cost = CostModel(
        cache_tokens=args.cache_tokens, max_running=args.max_running,
        prefill_us_per_token=args.prefill_us, decode_ms_per_token=args.decode_ms,
    )  # fmt: skip
    pinned = replace(cost, pin_budget=args.pin_budget, pin_max_ttl_s=ttl)
    config = RouterConfig(policy="cache_aware")
    count = int(args.background_rate * args.background_s)
    groups = min(args.background_groups, max(count, 1))
    bg = background_requests(count, args.background_rate, o.seed, groups) if count else []
    sides = [
        ("today", o, cost, 1),
        ("keys", replace(o, keys=True), cost, 1),
        ("keys+pins", replace(o, keys=True, pin_ttl_s=ttl), pinned, 1),
        ("keys+pins, 2 replicas", replace(o, keys=True, pin_ttl_s=ttl), pinned, 2),
    ]
    results = [
        simulate_agents(label, config, args.workers, c, opts, replicas=r, background=bg)
        for label, opts, c, r in sides
    ]
    alone = simulate_agents(
        "background alone", config, args.workers, cost, replace(o, sessions=0), background=bg
    )
    return results, {"background_alone_hit": alone.background_hit}


def table(results: list[AgentResult], extra: dict[str, float]) -> str:
    cols = [
        ("side", "label", "{}"), ("hit after 1st", "hit_after_first", "{:.3f}"),
        ("reuse after 1st", "reuse_after_first", "{:.3f}"),
        ("JCT mean s", "jct_mean_s", "{:.2f}"), ("JCT less gaps s", "jct_less_gaps_mean_s", "{:.2f}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
        ("siblings together", "siblings_colocated", "{:.3f}"),
        ("background hit", "background_hit", "{:.3f}"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        row = r.row()
        lines.append("| " + " | ".join(f.format(row[k]) for _, k, f in cols) + " |")
    today = results[0].row()
    best = results[2].row()
    lines.append("")
    lines.append(
        f"keys+pins / today: JCT {best['jct_mean_s'] / today['jct_mean_s']:.2f}x, "  # type: ignore[operator]
        f"JCT less gaps {best['jct_less_gaps_mean_s'] / today['jct_less_gaps_mean_s']:.2f}x; "  # type: ignore[operator]
        f"background alone hit {extra['background_alone_hit']:.3f}, beside agents "
        f"{best['background_hit']:.3f}"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.live:
        from loadtests.load.agent_live import run_live

        return run_live(args, _options(args))
    results, extra = run_sides(args)
    print(table(results, extra))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.row() for r in results], **extra}, f, indent=1)
    return 0
