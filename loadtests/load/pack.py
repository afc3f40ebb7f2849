"""`python -m loadtests pack`: one command, one report: how a fleet compares, per workload
and router, with the simulator's prediction beside every live number.

    python -m loadtests pack                                  # the small default, one command
    python -m loadtests pack --sglang-python /work/venv-sglang/bin/python --out loadtests/results
    python -m loadtests pack --host http://127.0.0.1:8000     # a fleet that is already running
    python -m loadtests pack --full                           # larger: 4x the requests

The pack is two tables, each entry one line: `WORKLOADS` (shared prefix with Zipf groups,
multi-turn, RAG, the Mooncake-format synthetic trace shipped in loadtests/traces/, an
eviction stress whose distinct prefixes are 2.5x the fleet's KV, and the agent and
multi-tenant workloads where this checkout has them) and the routers (our router with
each policy, and SGLang's `sglang-router` where it is importable or `--sglang-python`
names a Python that has it). An entry that cannot run is skipped with its reason, in the
report. Locally each workload gets a fresh sim fleet (Redis, 4 sim workers) and
`compare` runs every router over it, cold caches each time; with `--host` each workload
runs once against the given router (its workers flushed first where GET /workers lists
their URLs).

Writes `pack.md` and `pack.json` into `--out` (the serving figures under `vllm bench
serve`'s field names: request_throughput, output_throughput, mean_ttft_ms, median_ttft_ms,
p99_ttft_ms, mean_tpot_ms, ...), and `pack_hit_rate.png`, `pack_ttft.png` into `--plots`.
Each cell's prediction is the virtual-time simulator (loadtests/simulate/) replaying the
same requests with the same users, cost model and router settings: the hit rate must agree
within `HIT_TOLERANCE`, and a cell that does not has its gap named in the report
(differences in placement, prompt tokens, failures) so the reader can explain it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from loadtests.kit import Progress, WorkloadOptions, clock_text
from loadtests.load import fleet_queue
from loadtests.load.agents import AgentOptions, live_cell
from loadtests.load.cluster import ClusterSpec, WorkerSpec, sim_cluster
from loadtests.load.compare import POLICIES, SGLANG, compare, router_settings
from loadtests.load.runner import RunSpec, Summary, fleet_workers, run
from loadtests.load.workloads import shared_prefix, words
from loadtests.simulate.agents import simulate_agents
from loadtests.simulate.simulation import (
    ClosedLoop,
    LiveTokenizer,
    SimRequest,
    SimResult,
    Simulation,
)
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig
from shared.tokens.text_tokenizer import TextTokenizer

# Hit rates agree when |live - predicted| <= this share of the prediction (or 0.01
# absolute, where both are near zero and a share of nothing means nothing).
HIT_TOLERANCE = 0.10
HIT_FLOOR = 0.01
PREDICT_SEEDS = 5  # simulator runs per cell (tie-break seeds): a mean and a range
EVICTION_FOOTPRINT = 2.5  # eviction_stress: distinct prefix tokens / fleet KV tokens
# SGLang's router at its defaults (Cluster.start_sglang_router): predicted as our
# cache_aware with its thresholds, the closest rule we have.
# Its rule is the one DESIGN.md names (imbalance on the fleet's loads, else the best
# match over `cache_threshold`, else the smallest tree), at sglang_router 0.3.2's defaults.
SGLANG_AS = {"policy": "cache_aware", "cache_threshold": 0.3, "balance_abs_threshold": 64,
             "balance_rel_threshold": 1.5, "balance_mode": "fleet",
             "no_match": "smallest_tree"}  # fmt: skip


# Policies whose choice follows the loads at each arrival: the live run's timing (HTTP, a
# CPU shared with the client and the other processes, loads from in-flight counts and
# heartbeats) sets another interleaving than the simulator's virtual time; `random` also
# draws its own numbers. What such a gap means, in the report.
TIMING = {
    "cost_aware": "cost_aware weighs each worker's queued prefill, as heartbeats report it "
    "every 0.5 s live and exactly in the simulator: timing-bound",
    "least_load": "least_load follows the loads at each arrival: timing-bound",
    "power_of_two": "power_of_two follows the loads of two random workers: timing-bound",
    "random": "random draws other numbers live than in the simulator",
}


@dataclass(frozen=True)
class Size:
    """The fleet and the scale of every workload: `small` fits in 15 minutes on the
    2-core development machine; `full` has 4x its requests, twice the users and two
    more router variants."""

    name: str
    workers: int = 4
    cache_tokens: int = 4096  # per worker: the compare defaults, where routing decides
    prefill_us: float = 100.0
    decode_ms: float = 2.0
    max_running: int = 8
    users: int = 8
    scale: float = 2.0  # requests x scale
    # Our router with each policy (compare's names); sglang-router joins where it can run.
    routers: tuple[str, ...] = ("cache_aware (fleet)", "cost_aware", "least_load", "power_of_two",
                                "random", "consistent_hash", "round_robin")  # fmt: skip


SMALL = Size("small")
FULL = Size("full", scale=8, users=16,
            routers=("cache_aware (per_request)", "cost_aware (miss x2)", *SMALL.routers))  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One workload of the pack: `options(size)` its requests; `missing()` the reason it
    cannot run in this checkout (None: it can)."""

    name: str
    about: str
    options: Callable[[Size], WorkloadOptions]
    missing: Callable[[], str | None] = lambda: None
    # A workload with its own driver (sessions with tool gaps, tenants through the
    # fleet queue): its cells, live and predicted, on a local fleet; None: `compare`.
    cells: Callable[[Size, list[str]], list[Cell]] | None = None


def n(count: int, s: Size) -> int:
    """`count` requests (or groups, conversations) at the size's scale, at least one."""
    return max(1, round(count * s.scale))


def _base(workload: str, s: Size, **kw: object) -> WorkloadOptions:
    return WorkloadOptions(workload=workload, question_len=24, output_len=16, **kw)  # type: ignore[arg-type]


def eviction_options(s: Size) -> WorkloadOptions:
    """Shared prefix with enough groups that their system prompts, in the workers' own
    tokens, are `EVICTION_FOOTPRINT` x the fleet's KV: every policy must evict."""
    one = _base("shared_prefix", s, groups=1, prompts_per_group=1, system_len=1024)
    per_group = prefix_tokens(one) or 1
    groups = math.ceil(EVICTION_FOOTPRINT * s.workers * s.cache_tokens / per_group)
    return replace(one, groups=groups, prompts_per_group=n(3, s))


def prefix_tokens(o: WorkloadOptions) -> int:
    """Tokens (the sim workers' tokenizer) of a shared-prefix workload's distinct system prompts."""
    systems = {r.messages[0][1] for r in shared_prefix(o)}
    tok = TextTokenizer()
    return sum(len(tok.encode(s)) for s in systems)


# -- workloads with their own driver ---------------------------------------------------
# The agent workload (loadtests/load/agents.py) at the pack's scale: its shape (a long
# starting context, log-uniform tool outputs appended each call, log-normal tool gaps,
# fan-out siblings) with every length divided by about 20 to fit the pack's KV (about two
# of the sim workers' tokens a word) and the gaps sped up 40x (median 0.5 s).
PACK_AGENTS = AgentOptions(
    sessions=8, calls_min=3, calls_max=5, session_rate=2.0, context_min=300, context_max=900,
    user_words=20, tool_min=25, tool_max=400, output_tokens=16, speedup=40.0, fanout_p=0.25,
    fanout_max=4,
)  # fmt: skip
TODAY_AGENTS = "cache_aware (fleet), no keys or pins"


def agent_cells(s: Size, routers: list[str]) -> list[Cell]:
    """Our routers with the agent workload as a framework sends it (`prompt_cache_key`,
    `cache_pin_ttl` for its longest gap; the workers' pin budget at its default), and
    cache_aware without either (today's agents); sglang-router is not run (it reads
    neither field). Live: a fresh fleet per router; predicted: the agent simulator
    (loadtests/simulate/agents.py) with the same sessions, in the live workers' tokens."""
    o = replace(PACK_AGENTS, sessions=n(4, s))
    ttl = o.gap_max_s / o.speedup
    spec = WorkerSpec(decode_ms=s.decode_ms, prefill_us=s.prefill_us,
                      cache_tokens=s.cache_tokens, heartbeat_s=0.5, max_running=s.max_running,
                      extra=("--log-level", "WARNING"))  # fmt: skip
    keyed = replace(o, keys=True, pin_ttl_s=ttl)
    sides = [(r, r, keyed) for r in routers if r != SGLANG]
    sides.append((TODAY_AGENTS, "cache_aware (fleet)", replace(o, keys=False, pin_ttl_s=0.0)))
    cells = []
    for label, name, opts in sides:
        live = live_cell(spec, s.workers, router_settings(name, settings(s)), opts)  # type: ignore[arg-type]
        cost = CostModel(s.prefill_us, s.decode_ms, s.max_running, s.cache_tokens,
                         decode_us_per_1k_context=0.0,
                         pin_budget=0.25 if opts.pin_ttl_s else 0.0, pin_max_ttl_s=ttl)  # fmt: skip
        config = router_config(name, settings(s))
        rows = [simulate_agents(label, config, s.workers, cost, opts, seed=seed,
                                tokenizer=LiveTokenizer()).row()
                for seed in range(PREDICT_SEEDS)]  # fmt: skip
        sim = _mean_of(rows, ("hit_rate", "request_throughput", "median_ttft_ms",
                              "hit_after_first", "jct_mean_s", "siblings_colocated"))  # fmt: skip
        cells.append(_cell("agent", label, live, sim, name))
    return cells


def tenant_cells(s: Size, routers: list[str]) -> list[Cell]:
    """The multi-tenant workload of `python -m loadtests fleet-queue` (its schedule,
    tenants, classes, client and router config: loadtests/load/fleet_queue.py, at its
    defaults over `s.workers` workers of `s.cache_tokens`, 10 s at its saturation rate),
    through each of our routers with the fleet queue on. Predicted by the fleet
    simulator replaying the same prompts at the same times through the same policy:
    where they go, not when (it has no fleet queue: a 429 live is a request it serves)."""
    parser = argparse.ArgumentParser()
    fleet_queue.add_arguments(parser)
    a = parser.parse_args(["--workers", str(s.workers), "--seconds", str(10 * s.scale / 2)])
    fleet_queue.OUTPUT[0] = a.output_len
    plan = fleet_queue.schedule(a, fleet_queue.saturation_rate(a))
    spec = WorkerSpec(decode_ms=a.decode_ms, prefill_us=a.prefill_us, cache_tokens=s.cache_tokens,
                      heartbeat_s=0.2, max_running=a.max_running, extra=("--log-level", "WARNING"))  # fmt: skip
    cost = CostModel(a.prefill_us, a.decode_ms, a.max_running, s.cache_tokens,
                     decode_us_per_1k_context=0.0)  # fmt: skip
    cells = []
    with tempfile.TemporaryDirectory() as tmp, sim_cluster(a.workers, spec) as fleet:
        for i, name in enumerate(r for r in routers if r != SGLANG):
            config = {**fleet_queue.router_config(a, new=True, sync=False),
                      **router_settings(name, settings(s))}  # fmt: skip
            child = fleet_queue.start_router(fleet, f"tenants-{i}", config, None, Path(tmp))
            sent = [fleet_queue.Sent(x.at, x.tenant, x.klass, x.prompt) for x in plan]
            out = asyncio.run(fleet_queue.run_side(a, fleet, [child.url], sent, True))
            child.stop(grace_s=5)
            fleet.others.remove(child)
            ttft = np.array([x.ttft for x in sent if x.ttft is not None]) * 1e3
            live = {
                "completed": sum(x.status == 200 for x in sent),
                "failed": sum(x.status != 200 for x in sent),
                "request_throughput": sum(x.status == 200 for x in sent) / a.seconds,
                "mean_ttft_ms": float(ttft.mean()) if len(ttft) else math.nan,
                "median_ttft_ms": float(np.median(ttft)) if len(ttft) else math.nan,
                "p99_ttft_ms": float(np.percentile(ttft, 99)) if len(ttft) else math.nan,
                "hit_rate": out["hit_rate"] or 0.0, "goodput_rps": out["goodput_rps"],
                "jain": out["jain"], "http_429": sum(x.status == 429 for x in sent),
            }  # fmt: skip
            config_sim = router_config(name, settings(s))
            runs = []
            for seed in range(PREDICT_SEEDS):
                tok = LiveTokenizer()
                sim = Simulation(config_sim, a.workers, cost, seed=seed, tokenizer=tok)
                source = (SimRequest(x.at, x.prompt, tok.encode(x.prompt), a.output_len)
                          for x in plan)  # fmt: skip
                sim.run(source=source)
                runs.append(sim_fields(sim.result(name, measure_memory=False)))
            sim_row = _mean_of(runs, ("hit_rate", "request_throughput", "median_ttft_ms"))
            cells.append(_cell("multi_tenant", name, live, sim_row, name))
    return cells


def _mean_of(rows: list[dict], keys: tuple[str, ...]) -> dict[str, object]:
    """The prediction over tie-break seeds: each figure's mean, the hit rate's range."""
    out: dict[str, object] = {k: float(np.mean([float(r[k]) for r in rows])) for k in keys}
    hits = [float(r["hit_rate"]) for r in rows]
    return out | {"hit_rate_min": min(hits), "hit_rate_max": max(hits), "seeds": len(rows)}


def _cell(workload: str, label: str, live: dict, sim: dict, router: str) -> Cell:
    """A cell of a workload with its own driver; its gap named as `gap_named` does."""
    ok = agrees(float(live["hit_rate"]), float(sim["hit_rate"]))
    parts = [] if ok else _gap_parts(float(live["hit_rate"]), sim, router)
    if not ok and workload == "multi_tenant":
        parts.append("the simulator has no fleet queue, which live gives a request whose "
                     "worker has no free seat to another one (not measured per cell: the "
                     "likely cause where a load-blind policy disagrees)")  # fmt: skip
        if live.get("http_429"):
            parts.append(f"{live['http_429']} requests refused (429) live by the fleet queue")
    return Cell(workload, label, live, sim, ok, "; ".join(parts))


WORKLOADS: tuple[Entry, ...] = (
    Entry("shared_prefix_zipf", "8 system prompts of 512 words, groups drawn Zipf 1.1",
          lambda s: _base("shared_prefix", s, groups=8, prompts_per_group=n(12, s),
                          system_len=512, group_zipf=1.1)),
    Entry("multi_turn", "chats of 4 turns over one 256-word system prompt, closed loop",
          lambda s: _base("multi_turn", s, conversations=n(16, s), turns=4, system_len=256)),
    Entry("rag", "2 of 32 documents (256 words) per question, Zipf 1.1",
          lambda s: _base("rag", s, docs=32, doc_len=256, docs_per_request=2,
                          rag_requests=n(96, s))),
    Entry("mooncake", "the first lines of the synthetic Mooncake-format trace (loadtests/traces/), 4 words a block",
          lambda s: _base("mooncake", s, block_words=4, trace_limit=n(384, s),
                          arrival="asap", max_output=16)),
    Entry("eviction_stress",
          f"shared prefix whose distinct prompts are {EVICTION_FOOTPRINT}x the fleet's KV",
          eviction_options),
    Entry("agent", "agent sessions (loadtests/load/agents.py, scaled down): tool gaps, "
          "fan-out siblings, prompt_cache_key and pins", lambda s: WorkloadOptions(),
          cells=agent_cells),
    Entry("multi_tenant", "fleet-queue's tenants and classes, one flooding, at saturation",
          lambda s: WorkloadOptions(), cells=tenant_cells),
)  # fmt: skip


# -- routers ---------------------------------------------------------------------------
def sglang_python(given: str | None) -> tuple[str | None, str]:
    """The Python to run sglang-router with, and why (or why it is skipped)."""
    if given:
        return given, f"--sglang-python {given}"
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable, "importable here"
    return None, "skipped: sglang_router is not importable here and no --sglang-python was given"


def router_config(name: str, settings: dict[str, str]) -> RouterConfig:
    """The live router's settings as the simulator's RouterConfig (SGLang's: `SGLANG_AS`,
    which counts characters and learns nothing from answers)."""
    if name == SGLANG:
        return RouterConfig(**SGLANG_AS)  # type: ignore[arg-type]
    keys = router_settings(name, settings)
    keys.pop("log_level", None)
    # The live router learns each worker's characters per token from its answers
    # (router/fleet/calibration.py); the simulator does not, so it starts there.
    return RouterConfig(**{"tree_chars_per_token": chars_per_token(), **keys})  # type: ignore[arg-type]


@functools.cache
def chars_per_token() -> float:
    """Characters per token of the generated words in the sim workers' tokenizer (about
    2.5: every workload's text is words of `workloads.VOCAB`)."""
    text = words(random.Random(0), 4000)
    return len(text) / len(TextTokenizer().encode(text))


# -- the simulator's prediction ------------------------------------------------------------
def predict(o: WorkloadOptions, config: RouterConfig, s: Size, users: int) -> dict[str, object]:
    """The same requests, users, cost model and router settings in virtual time, once per
    tie-break seed of `PREDICT_SEEDS`: the mean of each figure, and the hit rate's range
    (the simulator's own run-to-run spread at this size)."""
    cost = CostModel(s.prefill_us, s.decode_ms, s.max_running, s.cache_tokens,
                     decode_us_per_1k_context=0.0)  # the live sim worker's default  # fmt: skip
    runs = []
    for seed in range(PREDICT_SEEDS):
        sim = Simulation(config, s.workers, cost, seed=seed, tokenizer=LiveTokenizer())
        sim.run(closed=ClosedLoop(o, users=users))
        runs.append(sim_fields(sim.result(config.policy, measure_memory=False)))
    out: dict[str, object] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    hits = [float(r["hit_rate"]) for r in runs]
    out |= {"hit_rate_min": min(hits), "hit_rate_max": max(hits), "seeds": PREDICT_SEEDS}
    return out


def sim_fields(r: SimResult) -> dict[str, float | int]:
    ttft = r.ttft * 1e3
    e2e = r.e2e * 1e3
    return {
        "completed": r.requests,
        "rejected": r.rejected,
        "request_throughput": r.requests / r.makespan if r.makespan else 0.0,
        "mean_ttft_ms": float(ttft.mean()) if len(ttft) else math.nan,
        "median_ttft_ms": float(np.median(ttft)) if len(ttft) else math.nan,
        "p99_ttft_ms": r.pct(ttft, 99),
        "mean_e2el_ms": float(e2e.mean()) if len(e2e) else math.nan,
        "hit_rate": r.hit_rate,
        "load_max_over_mean": r.load_max_over_mean,
        "prompt_tokens_per_request": r.prompt_tokens / r.requests if r.requests else 0.0,
        "balance_share": r.reasons.get("balance", 0) / r.requests if r.requests else 0.0,
    }


def agrees(live: float, predicted: float) -> bool:
    return abs(live - predicted) <= max(HIT_TOLERANCE * predicted, HIT_FLOOR)


def gap_named(live: Summary, sim: dict[str, object], router: str) -> str:
    """What differs between the live run and the prediction, measured, for a cell whose
    hit rates disagree: the reader's starting point for the explanation."""
    s = live.serving
    parts = _gap_parts(live.hit_rate, sim, router)
    if live.failures:
        parts.append(f"{live.failures} live requests failed")
    spread, sim_spread = live.load_max_over_mean, float(sim["load_max_over_mean"])  # type: ignore[arg-type]
    if abs(spread - sim_spread) > 0.15:
        parts.append(f"placement differs: max/mean requests per worker {spread:.2f} live, "
                     f"{sim_spread:.2f} predicted")  # fmt: skip
    live_tokens = s.total_input_tokens / s.completed if s.completed else 0.0
    sim_tokens = float(sim["prompt_tokens_per_request"])  # type: ignore[arg-type]
    if sim_tokens and abs(live_tokens / sim_tokens - 1) > 0.05:
        parts.append(f"prompt tokens per request {live_tokens:.0f} live (chat template, "
                     f"tokenizer) vs {sim_tokens:.0f} predicted (one per word)")  # fmt: skip
    return "; ".join(parts)


def _gap_parts(hit: float, sim: dict[str, object], router: str) -> list[str]:
    """The gap, whether the simulator's own range covers it, and what about the router
    is timing-bound or approximated."""
    parts = [f"live {hit:.3f} vs predicted {sim['hit_rate']:.3f} "
             f"({100 * (hit - float(sim['hit_rate'])):+.1f} points)"]  # type: ignore[arg-type]  # fmt: skip
    low, high = float(sim["hit_rate_min"]), float(sim["hit_rate_max"])  # type: ignore[arg-type]
    if low <= hit <= high:
        parts.append(f"inside the simulator's own range over {sim['seeds']} seeds "
                     f"({low:.3f}-{high:.3f}): the noise of a run this small")  # fmt: skip
    if router == SGLANG:
        parts.append("sglang-router is predicted as our cache_aware at its thresholds")
    why = TIMING.get(router.split(" (")[0])
    if why:
        parts.append(why)
    return parts


# -- running ---------------------------------------------------------------------------------
def fleet_at(host: str, api_key: str = "") -> list[dict[str, object]]:
    """The workers GET /workers lists at `host` (empty where it has no such list)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(host.rstrip("/") + "/workers", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            data = json.load(r)["data"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [w for w in data if isinstance(w, dict)] if isinstance(data, list) else []


def host_size(size: Size, fleet: list[dict[str, object]]) -> Size:
    """`--host`: the prediction's fleet is the one the router lists (its workers and their
    smallest KV capacity); the cost model stays the size's."""
    caps = [int(w["kv_capacity_tokens"]) for w in fleet if w.get("kv_capacity_tokens")]  # type: ignore[call-overload]
    return replace(
        size, workers=len(fleet) or size.workers, cache_tokens=min(caps, default=size.cache_tokens)
    )


def flush(fleet: list[dict[str, object]]) -> str:
    """Flush every listed worker's cache (POST /flush_cache); says what it did."""
    urls = [str(w["url"]) for w in fleet if w.get("url")]
    try:
        for url in urls:
            req = urllib.request.Request(url + "/flush_cache", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10).close()
    except OSError as e:
        return f"caches not flushed ({e}): warm from earlier traffic"
    return f"{len(urls)} workers flushed first" if urls else "no worker URLs listed: not flushed"


def run_live(
    o: WorkloadOptions, s: Size, routers: list[str], sglang: str | None, work: Path,
    host: str | None, api_key: str,
) -> dict[str, Summary]:  # fmt: skip
    """Every router over one workload: a fresh local fleet, or the fleet at `host`."""
    spec = RunSpec(host=host or "", out=work, users=s.users, model="sim" if not host else "",
                   timeout_s=600, api_key=api_key)  # fmt: skip
    if host:
        print(f"{o.workload} at {host}: {flush(fleet_at(host, api_key))}", file=sys.stderr)
        workers = fleet_workers(host, api_key) or ()
        return {f"fleet at {host}": run(spec, o, title=o.workload, quiet=True).over_fleet(workers)}
    fleet = ClusterSpec(workers=s.workers, cache_tokens=s.cache_tokens,
                        prefill_us_per_token=s.prefill_us, decode_ms_per_token=s.decode_ms,
                        max_running_requests=s.max_running)  # fmt: skip
    ours = [r for r in routers if r != SGLANG]
    return compare(fleet, o, spec, ours, settings(s), sglang if SGLANG in routers else None)


def settings(s: Size) -> dict[str, str]:
    """Every router's keys, as `compare` sets them: the imbalance gap at half a batch."""
    return {"balance_abs_threshold": str(max(1, s.max_running // 2))}


@dataclass
class Cell:
    """One workload under one router: the live figures (vLLM's names), the prediction,
    whether their hit rates agree, and what differs where they do not."""

    workload: str
    router: str
    live: dict[str, object]
    predicted: dict[str, object]
    agrees: bool
    gap: str = ""


def pack(args: argparse.Namespace) -> dict[str, object]:
    """Run every workload this checkout has under every router, predict each cell, and
    return the report (what `pack.json` holds)."""
    size = FULL if args.full else SMALL
    if args.users:
        size = replace(size, users=args.users)
    if args.scale:
        size = replace(size, scale=args.scale)
    asked = [r.strip() for r in args.routers.split(",") if r.strip()]
    routers = [r for r in asked if r != SGLANG] if asked else list(size.routers)
    py, sglang_note = sglang_python(args.sglang_python)
    if args.host:
        routers, sglang_note = [f"fleet at {args.host}"], "not run: --host runs the given fleet"
        size = host_size(size, fleet_at(args.host, args.api_key))
    elif asked and SGLANG not in asked:
        sglang_note = "skipped: not in --routers"
    elif py:
        routers.append(SGLANG)
    wanted = {w.strip() for w in args.workloads.split(",")} if args.workloads else None
    workloads: list[dict[str, object]] = []
    chosen: list[tuple[Entry, WorkloadOptions]] = []
    for e in WORKLOADS:
        reason = (
            "not in --workloads" if wanted is not None and e.name not in wanted else e.missing()
        )
        if reason is None and e.cells is not None and args.host:
            reason = "its own driver runs on a local fleet only: not with --host"
        row: dict[str, object] = {"name": e.name, "about": e.about, "skipped": reason}
        if reason is None:
            o = e.options(size)
            chosen.append((e, o))
            if e.name == "eviction_stress":
                tokens = prefix_tokens(o)
                row["prefix_tokens"] = tokens
                row["fleet_kv_tokens"] = size.workers * size.cache_tokens
                row["footprint_x_fleet_kv"] = tokens / (size.workers * size.cache_tokens)
        workloads.append(row)
    cells: list[Cell] = []
    progress = Progress("pack", 2 * len(chosen))
    for e, o in chosen:
        if e.cells is not None:
            progress.say(f"{e.name}: {len(routers)} routers, live and predicted")
            cells += e.cells(size, routers)
            progress.finished()
            progress.finished(f"{e.name}: done")
            continue
        progress.say(f"{e.name}: {len(routers)} routers, live")
        live = run_live(o, size, routers, py, args.work / e.name, args.host, args.api_key)
        progress.finished()
        progress.say(f"{e.name}: the simulator's predictions")
        base = settings(size)
        for name, summary in live.items():
            config = (
                router_config(name, base)
                if not args.host
                else RouterConfig(policy=args.host_policy)
            )  # type: ignore[arg-type]
            sim = predict(o, config, size, size.users)
            ok = agrees(summary.hit_rate, float(sim["hit_rate"]))  # type: ignore[arg-type]
            cells.append(Cell(e.name, name, {**summary.to_dict(), "per_worker": None}, sim, ok,
                              "" if ok else gap_named(summary, sim, name)))  # fmt: skip
        progress.finished(f"{e.name}: done")
    return {
        "command": args.command_line,
        "size": dataclasses.asdict(size),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
        },
        "elapsed_s": progress.elapsed,
        "hit_tolerance": HIT_TOLERANCE,
        "workloads": workloads,
        "routers": {"run": routers, "sglang-router": sglang_note},
        "cells": [dataclasses.asdict(c) for c in cells],
    }


# -- the report ----------------------------------------------------------------------------
# (vLLM field, heading, digits) of each live column; None in a cell prints as "-".
LIVE_COLUMNS = (
    ("completed", "completed", 0), ("failed", "failed", 0),
    ("request_throughput", "request_throughput (req/s)", 2),
    ("output_throughput", "output_throughput (tok/s)", 0),
    ("mean_ttft_ms", "mean_ttft_ms", 0), ("median_ttft_ms", "median_ttft_ms", 0),
    ("p99_ttft_ms", "p99_ttft_ms", 0), ("mean_tpot_ms", "mean_tpot_ms", 1),
    ("p99_e2el_ms", "p99_e2el_ms", 0), ("load_max_over_mean", "max/mean per worker", 2),
)  # fmt: skip
SIM_COLUMNS = (
    ("request_throughput", "predicted request_throughput", 2),
    ("median_ttft_ms", "predicted median_ttft_ms", 0),
)


# The figures of a workload with its own driver, beside the common columns: (key,
# heading, digits); the prediction's where it has one.
OWN_COLUMNS = {
    "agent": (("hit_after_first", "hit rate after the 1st call", 3),
              ("jct_mean_s", "JCT mean s", 2), ("siblings_colocated", "siblings together", 3)),
    "multi_tenant": (("goodput_rps", "goodput@SLO req/s", 2), ("jain", "Jain over tenants", 3),
                     ("http_429", "429s", 0)),
}  # fmt: skip


def _fmt(v: object, digits: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, (int, float)) else str(v)


def markdown(report: dict[str, object]) -> str:
    cells: list[dict] = report["cells"]  # type: ignore[assignment]
    size: dict = report["size"]  # type: ignore[assignment]
    machine: dict = report["machine"]  # type: ignore[assignment]
    load = ", ".join(f"{x:.1f}" for x in machine["load_average_at_end"])
    out = [
        "# The pack: every workload against every router, live and predicted", "",
        f"Command: `{report['command']}`", "",
        f"{size['workers']} sim workers ({size['cache_tokens']:,} KV tokens each, prefill "
        f"{size['prefill_us']:g} µs per uncached token, decode {size['decode_ms']:g} ms per "
        f"token, {size['max_running']} running at once), {size['users']} closed-loop users, "
        f"size `{size['name']}`. Ran {clock_text(float(report['elapsed_s']))} on "  # type: ignore[arg-type]
        f"{machine['cpus']} CPUs, load average {load} at the end: the machine was shared, "
        "so latencies and throughputs are pessimistic and noisy; hit rates are not "
        "timing-bound and compare across runs.", "",
        "Live figures use `vllm bench serve`'s field names (loadtests/load/summary.py). "
        "The prediction is the virtual-time simulator (loadtests/simulate/) replaying the "
        "same requests through the same router settings over the engine's own scheduler "
        f"and radix cache, in the live workers' tokens; its mean over {PREDICT_SEEDS} "
        "tie-break seeds, with their range. Hit rates agree when within "
        f"{HIT_TOLERANCE:.0%} of the prediction (or {HIT_FLOOR} absolute). Predicted "
        "latencies are the cost model's alone (no HTTP, no CPU contention).", "",
        "## What ran", "", "| workload | what | ran |", "|---|---|---|",
    ]  # fmt: skip
    for w in report["workloads"]:  # type: ignore[attr-defined]
        ran = "yes" if w["skipped"] is None else f"skipped: {w['skipped']}"
        if "footprint_x_fleet_kv" in w:
            ran += (f" (distinct prefixes {w['prefix_tokens']:,} tokens = "
                    f"{w['footprint_x_fleet_kv']:.2f}x the fleet's {w['fleet_kv_tokens']:,})")  # fmt: skip
        out.append(f"| {w['name']} | {w['about']} | {ran} |")
    routers: dict = report["routers"]  # type: ignore[assignment]
    out += ["", f"Routers: {', '.join(routers['run'])}. sglang-router: {routers['sglang-router']}."]
    for name in dict.fromkeys(c["workload"] for c in cells):
        rows = [c for c in cells if c["workload"] == name]
        heads = ["router", *(h for _, h, _ in LIVE_COLUMNS), "hit_rate",
                 "predicted hit_rate (range)",
                 "agree", *(h for _, h, _ in SIM_COLUMNS)]  # fmt: skip
        out += ["", f"## {name}", "", "| " + " | ".join(heads) + " |",
                "|---|" + "---:|" * (len(heads) - 1)]  # fmt: skip
        for c in rows:
            live, sim = c["live"], c["predicted"]
            values = [c["router"], *(_fmt(live.get(k), d) for k, _, d in LIVE_COLUMNS),
                      _fmt(live["hit_rate"], 3),
                      f"{sim['hit_rate']:.3f} ({sim['hit_rate_min']:.3f}-{sim['hit_rate_max']:.3f})",
                      "yes" if c["agrees"] else "**no**",
                      *(_fmt(sim.get(k), d) for k, _, d in SIM_COLUMNS)]  # fmt: skip
            out.append("| " + " | ".join(values) + " |")
        own = OWN_COLUMNS.get(name)
        if own:
            heads = ["router", *(f"{h} (predicted)" for _, h, _ in own)]
            out += ["", "| " + " | ".join(heads) + " |", "|---|" + "---:|" * len(own)]
            for c in rows:
                live, sim = c["live"], c["predicted"]
                values = [c["router"]] + [
                    _fmt(live.get(k), d) + (f" ({_fmt(sim[k], d)})" if k in sim else "")
                    for k, _, d in own
                ]
                out.append("| " + " | ".join(values) + " |")
    gaps = [c for c in cells if not c["agrees"]]
    out += ["", "## Hit rate, live vs predicted", ""]
    if not gaps:
        out.append(f"Every cell agrees within {HIT_TOLERANCE:.0%}.")
    else:
        out.append(f"{len(cells) - len(gaps)} of {len(cells)} cells agree. The others, with what "
                   "was measured to differ:")  # fmt: skip
        out += [""] + [f"- {c['workload']} / {c['router']}: {c['gap']}" for c in gaps]
    return "\n".join(out) + "\n"


def plot(report: dict[str, object], plots: Path) -> list[Path]:
    """Per workload: hit rate live vs predicted per router; TTFT median and p99 per router."""
    cells: list[dict] = report["cells"]  # type: ignore[assignment]
    names = list(dict.fromkeys(c["workload"] for c in cells))
    if not names:
        return []
    plots.mkdir(parents=True, exist_ok=True)
    paths = [plots / "pack_hit_rate.png", plots / "pack_ttft.png"]
    for path, panel in zip(paths, ("hit", "ttft"), strict=True):
        fig, axes = plt.subplots(1, len(names), figsize=(3.4 * len(names), 3.6), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            rows = [c for c in cells if c["workload"] == name]
            x = np.arange(len(rows))
            if panel == "hit":
                a = [c["live"]["hit_rate"] for c in rows]
                b = [c["predicted"]["hit_rate"] for c in rows]
                labels, top = ("live", "predicted"), 1.0
            else:
                a = [c["live"]["median_ttft_ms"] or 0 for c in rows]
                b = [c["live"]["p99_ttft_ms"] or 0 for c in rows]
                labels, top = ("median", "p99"), None
            ax.bar(x - 0.2, a, 0.4, label=labels[0], color="#4878d0")
            ax.bar(x + 0.2, b, 0.4, label=labels[1], color="#ee854a")
            ax.set_title(name, fontsize=9)
            ax.set_xticks(x)
            ax.set_xticklabels([c["router"].replace("cache_aware ", "ca ") for c in rows],
                               rotation=40, ha="right", fontsize=7)  # fmt: skip
            if top:
                ax.set_ylim(0, top)
        axes[0][0].set_ylabel("cache hit rate" if panel == "hit" else "TTFT (ms, live)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument(
        "--full", action="store_true", help="4x the requests, 16 users, two more router variants"
    )
    p.add_argument("--host", default=None,
                   help="a running router's URL: each workload runs once against it "
                   "(default: a local sim fleet per workload)")  # fmt: skip
    p.add_argument(
        "--host-policy",
        default="cache_aware",
        help=f"--host: the policy the simulator predicts that fleet with {d}",
    )
    p.add_argument("--api-key", default="", help="--host: bearer token for the router")
    p.add_argument(
        "--routers",
        default="",
        help=f"comma-separated, of: {', '.join(POLICIES)} (default: the size's list)",
    )
    p.add_argument("--workloads", default="",
                   help=f"comma-separated, of: {', '.join(e.name for e in WORKLOADS)} "
                   "(default: all that this checkout has)")  # fmt: skip
    p.add_argument(
        "--users",
        type=int,
        default=0,
        help="closed-loop users (default: the size's, 8 small / 16 full)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=0.0,
        help="requests per workload x this (default: the size's, 2 small / 8 full)",
    )
    p.add_argument("--sglang-python", default=None,
                   help="a Python with sglang-router installed (default: this one, where it "
                   "has sglang_router; else sglang-router is skipped)")  # fmt: skip
    p.add_argument(
        "--out",
        type=Path,
        default=Path("loadtests/out/pack"),
        help=f"folder for pack.md and pack.json {d}",
    )
    p.add_argument("--plots", type=Path, default=None, help="folder for the PNGs (default: OUT)")
    p.add_argument(
        "--work",
        type=Path,
        default=Path("loadtests/out/pack/runs"),
        help=f"each run's locust output and records {d}",
    )


def main(args: argparse.Namespace) -> int:
    unknown = [r for r in (args.routers or "").split(",") if r.strip() and r.strip() not in
               (*POLICIES, SGLANG)]  # fmt: skip
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {list(POLICIES)}")
    names = {e.name for e in WORKLOADS}
    bad = [w for w in (args.workloads or "").split(",") if w.strip() and w.strip() not in names]
    if bad:
        raise ValueError(f"unknown workloads {bad}; choose from {sorted(names)}")
    if args.users < 0 or args.scale < 0:
        raise ValueError(f"--users and --scale must be >= 0, got {args.users}, {args.scale}")
    started = time.monotonic()
    report = pack(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pack.json").write_text(json.dumps(report, indent=2, default=_json) + "\n")
    text = markdown(report)
    (args.out / "pack.md").write_text(text)
    paths = plot(report, args.plots or args.out)
    print(text)
    cells: list[dict] = report["cells"]  # type: ignore[assignment]
    failed = sum(int(c["live"]["failed"]) for c in cells)
    agree = sum(c["agrees"] for c in cells)
    print(f"report: {args.out / 'pack.md'}, {args.out / 'pack.json'}; plots: "
          f"{', '.join(map(str, paths)) or 'none'}")  # fmt: skip
    print(f"verdict: {len(cells)} cells, {failed} requests failed, hit rate agrees with the "
          f"simulator in {agree} of {len(cells)} ({clock_text(time.monotonic() - started)})")  # fmt: skip
    return 1 if failed or not cells else 0


def _json(v: object) -> object:
    """NaN-free JSON: a float that is not a number is null."""
    return None if isinstance(v, float) and math.isnan(v) else str(v)
