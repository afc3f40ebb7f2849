"""`radix-router`: `serve` runs the router; `up` starts a whole local fleet.

    radix-router serve --policy cache_aware --redis-url redis://... --port 8000
    radix-router serve --worker-url http://10.0.0.5:8001 --worker-url http://10.0.0.6:8001
    radix-router up --workers 2 --engine radix

Flags override the environment (`RADIX_ROUTER_*`), which overrides `--config FILE`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, get_args

from shared.config import ConfigError, PolicyName, RouterConfig, load_config

POLICIES = get_args(PolicyName)


SERVE_DESCRIPTION = """Run the router: an OpenAI-compatible HTTP server that sends each request to the
worker most likely to hold its prompt's prefix in its KV cache (the rule is at the
top of router/policy). Workers come from Redis heartbeats (--redis-url) and/or --worker-url.
Every RouterConfig key (shared/config.py) can also be set in --config FILE or as
RADIX_ROUTER_<KEY>; flags win over the environment, which wins over the file."""

UP_DESCRIPTION = """Start a whole local fleet as child processes: a Redis-protocol server (embedded
Valkey unless --redis-url), N workers and the router. Checks the router port first,
prints the router URL, the model name, the dashboard URL and a first request. A process
that exits (Redis too) is reported and restarted; one that keeps exiting stops the fleet
and its log folder is kept. Ctrl-C stops every process it started and removes the log
folder (unless --keep-logs)."""


def _default(key: str) -> Any:
    return RouterConfig.model_fields[key].default


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML file of RouterConfig keys")
    p.add_argument("--host", help=f"bind address (default {_default('host')})")
    p.add_argument("--port", type=int, help=f"bind port (default {_default('port')}; 0: any free)")
    p.add_argument(
        "--policy", choices=POLICIES, help=f"routing policy (default {_default('policy')})"
    )
    p.add_argument(
        "--redis-url", dest="redis_url", metavar="URL",
        help="Redis to discover workers from, e.g. redis://127.0.0.1:6379/0 (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--worker-url", dest="worker_urls", action="append", metavar="URL",
        help="a static worker, http(s)://host:port (repeatable; default: none)",
    )  # fmt: skip
    p.add_argument(
        "--log-level",
        dest="log_level",
        help=f"DEBUG, INFO, WARNING (default {_default('log_level')})",
    )
    p.add_argument(
        "--processes",
        type=int,
        help="router processes on this host behind one port, routing as replicas (default 1)",
    )


def _up_flags(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--workers", type=int, default=2, help=f"worker processes {d}")
    p.add_argument(
        "--engine", choices=("radix", "sim"), default="radix",
        help="radix: our engine on a model (the tiny random-weight one unless --model); "
        f"sim: a cost model, no weights, no torch needed {d}",
    )  # fmt: skip
    p.add_argument(
        "--model", metavar="DIR",
        help="local Hugging Face model folder for the radix engine "
        "(default: a tiny random-weight model built once in --model-cache-dir)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help=f"bind address of every process {d}")
    p.add_argument("--port", type=int, default=8000, help=f"router port; 0: any free port {d}")
    p.add_argument(
        "--redis-url", dest="redis_url", metavar="URL",
        help="use this Redis instead of starting an embedded one (default: embedded)",
    )  # fmt: skip
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help=f"routing policy {d}")
    p.add_argument(
        "--cache-tokens", type=int, default=None, metavar="TOKENS",
        help="KV cache capacity per worker, in tokens "
        "(default: 32768 for radix, the worker's own default for sim)",
    )  # fmt: skip
    p.add_argument(
        "--max-running-requests", type=int, default=16, metavar="N",
        help=f"requests a worker runs at once; the router's balance threshold is half of it {d}",
    )  # fmt: skip
    p.add_argument(
        "--sim-prefill-us-per-token", type=float, default=None, metavar="US",
        help="sim engine: prefill cost in microseconds per uncached prompt token (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--sim-decode-ms-per-token", type=float, default=None, metavar="MS",
        help="sim engine: decode cost in milliseconds per output token (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--model-cache-dir", default=None, metavar="DIR",
        help="where the tiny model is built once (default: ~/.cache/radix-router/tiny-model)",
    )  # fmt: skip
    p.add_argument(
        "--start-timeout", type=float, default=120.0, metavar="SECONDS",
        help=f"how long each child may take to answer /health {d}",
    )  # fmt: skip
    p.add_argument(
        "--keep-logs", action="store_true",
        help="keep the children's log folder on exit and print its path (default: removed "
        "on a clean exit, kept when the fleet fails)",
    )  # fmt: skip
    p.add_argument(
        "--no-kv-events", dest="kv_events", action="store_false",
        help="route on the prefix tree alone: workers publish no KV events and the router "
        "computes no prompt ids (default: on)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radix-router",
        description="Cache-aware router for LLM serving fleets. `serve` runs the router; "
        "`up` starts a local fleet (Redis, workers, router) for trying it out.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    _serve_flags(
        sub.add_parser(
            "serve", help="run the router", description=SERVE_DESCRIPTION, formatter_class=fmt
        )
    )
    _up_flags(
        sub.add_parser(
            "up",
            help="start Redis, N workers and the router locally",
            description=UP_DESCRIPTION,
            formatter_class=fmt,
        )
    )
    return parser


def serve_config(args: argparse.Namespace) -> RouterConfig:
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in ("host", "port", "policy", "redis_url", "worker_urls", "log_level", "processes")
    }
    return load_config(RouterConfig, args.config, overrides)


def _run_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    from router.http.app import run_router  # the serving path, imported only to serve

    if config.processes > 1:
        from router.up.processes import run_processes

        return run_processes(config, run_router)
    return run_router(config)


def _run_up(args: argparse.Namespace) -> int:
    from router.up.local_fleet import UpFleet, UpOptions

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    options = UpOptions(
        workers=args.workers, engine=args.engine, model=args.model, host=args.host, port=args.port,
        redis_url=args.redis_url, policy=args.policy, cache_tokens=args.cache_tokens,
        max_running_requests=args.max_running_requests,
        sim_prefill_us_per_token=args.sim_prefill_us_per_token,
        sim_decode_ms_per_token=args.sim_decode_ms_per_token,
        model_cache_dir=args.model_cache_dir, start_timeout=args.start_timeout,
        keep_logs=args.keep_logs, kv_events=args.kv_events,
    )  # fmt: skip
    return UpFleet(options).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _run_serve(args)
        return _run_up(args)
    except ConfigError as e:
        print(f"radix-router: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
