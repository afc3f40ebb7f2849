"""`python -m loadtests NAME [options]`: every load test and benchmark, started one way.

    python -m loadtests                 the commands, by section
    python -m loadtests NAME --help     one command: what it does, its options, defaults, units

Run from the repository root (`python -m` puts it on `sys.path`; nothing here edits it).
A command is a module of a section folder (load, simulate, router, engine, gpu) with
`add_arguments(parser)` and `main(args) -> int | None`, or a `kit.Command` holding that
pair in a module beside another command ("module:NAME" below); `args.command_line` is
the line that started it (for the tables written to `--out`). Its module is imported only when it
runs, so the list works before the `loadtest` extra (locust, matplotlib) is installed. To
add a benchmark, add a module to its section and a line to COMMANDS; the section is the
module's folder.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import signal
import sys

from loadtests.kit import Command, HelpFormatter

SECTIONS = {
    "load": "real processes under load",
    "simulate": "simulated workers, 8 to 1,000",
    "router": "the router's own costs",
    "engine": "the worker engine, on CPU",
    "gpu": "the engine on a CUDA device",
}

# name: (module or "module:NAME", what it does), in --help's order within each section
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "loadtests.load.runner",
        "locust, headless, against a URL: a workload, a report, plots",
    ),
    "report": ("loadtests.load.runner:REPORT", "the summary and plots of a records.jsonl again"),
    "compare": ("loadtests.load.compare", "routing policies side by side on a local sim fleet"),
    "sweep": (
        "loadtests.load.sweep",
        "request rates per policy: saturation point, goodput, a plot",
    ),
    "fleet-queue": (
        "loadtests.load.fleet_queue",
        "the fleet queue vs today's router: tenants, classes, one flooding, goodput at SLO",
    ),
    "replicas": ("loadtests.load.replicas", "router replicas with and without decision sync"),
    "faults": ("loadtests.load.faults", "worker, Redis and router faults under load, their cost"),
    "pack": (
        "loadtests.load.pack",
        "every workload against every router, live and predicted: one report",
    ),
    "simulate": (
        "loadtests.simulate.simulate",
        "the routing policies on 8-1,000 simulated workers",
    ),
    "simulate-events": (
        "loadtests.simulate.simulate:EVENTS",
        "tree vs tree + KV events vs a ceiling, divergence cases",
    ),
    "agent": (
        "loadtests.simulate.agents",
        "agent sessions (prompt_cache_key, pins, tool gaps): today vs keys vs pins",
    ),
    "host-tier": (
        "loadtests.simulate.simulate:HOST_TIER",
        "host KV tier 0 / 4x / 10x vs unbounded",
    ),
    "sim-calibrate": (
        "loadtests.simulate.worker:SIM_CALIBRATE",
        "fit the sim step price to CPU steps",
    ),
    "kv-events": (
        "loadtests.router.bench_kv_events",
        "tree alone vs tree + KV events, live: the real router, divergence cases",
    ),
    "kv-feed": ("loadtests.router.bench_kv_feed", "the KV feed applying a recorded event stream"),
    "kv-score": (
        "loadtests.router.bench_router_tokens:KV_SCORE",
        "a request's KV scoring in process: the on routing step vs tok's",
    ),
    "holdings-attacks": (
        "loadtests.load.faults_clients:HOLDINGS_ATTACKS",
        "a hostile worker credential and client: /health p99, RSS",
    ),
    "namespaces": (
        "loadtests.router.bench_kv_events:NAMESPACES",
        "predicted hits across cache_salt / template namespaces, before vs after",
    ),
    "policy-cost": ("loadtests.router.bench_policy", "CPU per routing decision as the fleet grows"),
    "tree": (
        "loadtests.router.bench_policy:TREE",
        "the router's prefix tree vs a pygtrie baseline",
    ),
    "router-overhead": ("loadtests.router.bench_router_overhead", "the router vs going direct"),
    "router-fleet-size": (
        "loadtests.router.bench_router_overhead:FLEET_SIZE",
        "router CPU vs fleet size",
    ),
    "router-wrk": (
        "loadtests.router.bench_router_wrk",
        "wrk through 1 and N router processes, TTFT",
    ),
    "router-profile": (
        "loadtests.router.bench_router_wrk:ROUTER_PROFILE",
        "where the router's CPU goes under wrk, per layer (cProfile), vs a git ref",
    ),
    "router-pieces": (
        "loadtests.router.bench_router_overhead:ROUTER_PIECES",
        "the request path's pieces in process (request model, queue, table), vs a git ref",
    ),
    "upstream-reuse": (
        "loadtests.router.bench_router_wrk:UPSTREAM_REUSE",
        "router CPU: a worker that echoes request ids vs one that does not",
    ),
    "chat-ids": (
        "loadtests.router.bench_router_tokens:CHAT_IDS",
        "a chat's prompt ids from its body in process: tok's reading vs off's",
    ),
    "router-tokens": (
        "loadtests.router.bench_router_tokens",
        "router CPU per request, prompt ids (tokenizer, KV index) on vs off",
    ),
    "sync-wire": (
        "loadtests.router.bench_router_tokens:SYNC_WIRE",
        "replica sync entries, text vs prompt ids: bytes and CPU per entry",
    ),
    "up-prediction": (
        "loadtests.router.bench_kv_events:UP_PREDICTION",
        "`radix-router up`: predicted vs actual cached tokens, KV events on/off",
    ),
    "engine": ("loadtests.engine.bench_engine", "TTFT cached vs uncached, decode tokens/s"),
    "scheduler": (
        "loadtests.engine.bench_engine:SCHEDULER",
        "one worker: fcfs vs lpm, in-flight sharing",
    ),
    "radix-cache": ("loadtests.engine.bench_radix_cache", "radix cache vs no cache on a trace"),
    "host-reload": (
        "loadtests.engine.bench_radix_cache:HOST_RELOAD",
        "reload N host tokens vs prefill",
    ),
    "host-step": (
        "loadtests.engine.bench_engine:HOST_STEP",
        "host work per decode step at batch 64",
    ),
    "worker-http": ("loadtests.engine.bench_worker_http", "the worker's HTTP layer vs in process"),
    # Imports only torch, numpy, transformers and the engine (no pydantic or redis).
    "gpu-check": ("loadtests.gpu.check", "the engine on a GPU: correctness, kernels, roofline"),
}


def section_of(target: str) -> str:
    return target.split(".")[1]


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [__doc__.strip().splitlines()[0]]
    for section, about in SECTIONS.items():
        lines += ["", f"{section}: {about}"]
        lines += [
            f"  {name:<{width}}  {text}"
            for name, (module, text) in COMMANDS.items()
            if section_of(module) == section
        ]
    lines += ["", "python -m loadtests NAME --help: that command's options, defaults and units"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: no command {name!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    target, text = COMMANDS[name]
    module_name, _, attr = target.partition(":")
    prog = f"python -m loadtests {name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        print(
            f"error: {prog} needs {e.name}: pip install -e '.[loadtest]' (or '.[dev]')",
            file=sys.stderr,
        )
        return 2
    command = getattr(module, attr) if attr else module
    description = command.description if isinstance(command, Command) else module.__doc__
    parser = argparse.ArgumentParser(
        prog=prog, description=description or text, formatter_class=HelpFormatter
    )
    command.add_arguments(parser)
    parser.set_defaults(command_line=f"{prog} {shlex.join(rest)}".strip())
    try:
        return int(command.main(parser.parse_args(rest)) or 0)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, `kill`) as Ctrl-C: its default ends the process without running
    `finally`, and a benchmark's fleet, children in their own sessions (shared/procs.py),
    outlived it. As KeyboardInterrupt every cluster's teardown runs and stops them."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
