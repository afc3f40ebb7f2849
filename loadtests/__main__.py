"""`python -m loadtests NAME [options]`: every load test and benchmark, started one way.

    python -m loadtests                 the list of commands
    python -m loadtests NAME --help     one command: what it does, its options, defaults, units

Run from the repository root (`python -m` puts it on `sys.path`; nothing here edits it).
A command is a module of this package with `main(argv) -> int | None`, or with
`add_arguments(parser)` and `main(args)`; its module is imported only when it runs, so
the list works before the `loadtest` extra (locust, matplotlib) is installed. To add a
benchmark, add a module and a line to COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "loadtests.load.runner",
        "locust, headless, against a URL: a workload, a report, plots",
    ),
    "report": ("loadtests.load.report", "the summary and plots of a records.jsonl again"),
    "compare": ("loadtests.load.compare", "routing policies side by side on a local sim fleet"),
    "sweep": (
        "loadtests.load.sweep",
        "request rates per policy: saturation point, goodput, a plot",
    ),
    "host-reload": (
        "loadtests.engine.bench_host_reload",
        "engine (CPU): reload N host tokens vs prefill",
    ),
    "host-tier": (
        "loadtests.simulate.bench_host_tier",
        "simulator: host KV tier 0 / 4x / 10x vs unbounded",
    ),
    "simulate": (
        "loadtests.simulate.simulate",
        "the routing policies on 8-1,000 simulated workers",
    ),
    "kv-feed": (
        "loadtests.router.bench_kv_feed",
        "router: the KV feed applying a recorded event stream",
    ),
    "simulate-events": (
        "loadtests.simulate.simulate_events",
        "simulator: tree vs tree + KV events vs a ceiling, divergence cases",
    ),
    "agent": (
        "loadtests.simulate.agent_bench",
        "agent sessions (prompt_cache_key, pins, tool gaps): today vs keys vs pins",
    ),
    "replicas": ("loadtests.load.replicas", "router replicas with and without decision sync"),
    "faults": ("loadtests.load.faults", "worker, Redis and router faults under load, their cost"),
    "engine": ("loadtests.engine.bench_engine", "engine: TTFT cached vs uncached, decode tokens/s"),
    "scheduler": (
        "loadtests.engine.bench_scheduler",
        "one worker: fcfs vs lpm, in-flight sharing on/off",
    ),
    "radix-cache": ("loadtests.engine.bench_radix_cache", "radix cache vs no cache on a trace"),
    "tree": ("loadtests.router.bench_tree", "the router's prefix tree vs a pygtrie baseline"),
    "policy-cost": ("loadtests.router.bench_policy", "CPU per routing decision as the fleet grows"),
    "router-overhead": ("loadtests.router.bench_router_overhead", "the router vs going direct"),
    "router-wrk": (
        "loadtests.router.bench_router_wrk",
        "wrk through 1 and N router processes, TTFT",
    ),
    "upstream-reuse": (
        "loadtests.router.bench_upstream_reuse",
        "router CPU: a worker that echoes request ids vs one that does not",
    ),
    "router-fleet-size": ("loadtests.router.bench_router_fleet_size", "router CPU vs fleet size"),
    "worker-http": ("loadtests.engine.bench_worker_http", "the worker's HTTP layer vs in process"),
    "registry-scan": (
        "loadtests.bench_registry_scan",
        "one read of the fleet registry: SCAN vs the old id set",
    ),
    "model-fusions": ("loadtests.bench_model_fusions", "merged projections, in-place RoPE (CPU)"),
    "sampler-filter": ("loadtests.bench_sampler_filter", "top-k/top-p: vocab sort vs thresholds"),
    "host-step": (
        "loadtests.engine.bench_host_step",
        "host work per decode step at batch 64, on/off",
    ),
    "sim-calibrate": (
        "loadtests.simulate.calibrate_sim_cost",
        "fit the sim step price to CPU steps",
    ),
    "runner-ab": ("loadtests.bench_runner_ab", "decode step time vs another checkout's runner"),
    # Imports only torch, numpy, transformers and the engine (no pydantic or redis).
    "gpu-check": ("loadtests.gpu.gpu_check", "the engine on a GPU: correctness, kernels, roofline"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [__doc__.strip().splitlines()[0], "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
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
    module_name, text = COMMANDS[name]
    prog = f"python -m loadtests {name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        print(
            f"error: {prog} needs {e.name}: pip install -e '.[loadtest]' (or '.[dev]')",
            file=sys.stderr,
        )
        return 2
    from loadtests.options import HelpFormatter

    try:
        if hasattr(module, "add_arguments"):
            doc = module.__doc__ or text
            parser = argparse.ArgumentParser(
                prog=prog, description=doc, formatter_class=HelpFormatter
            )
            module.add_arguments(parser)
            return int(module.main(parser.parse_args(rest)) or 0)
        # A benchmark with its own parser: it names itself after sys.argv[0].
        saved, sys.argv = sys.argv, [prog, *rest]
        try:
            return int(module.main(rest) or 0)
        finally:
            sys.argv = saved
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
