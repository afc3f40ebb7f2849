"""`radix-router`: `serve` runs the router; `up` starts a whole local fleet.

    radix-router serve --policy cache_aware --redis-url redis://... --port 8000
    radix-router serve --worker-url http://10.0.0.5:8001 --worker-url http://10.0.0.6:8001
    radix-router up --workers 2 --engine sim

Flags override the environment (`RADIX_ROUTER_*`), which overrides `--config FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from shared.config import ConfigError, RouterConfig, load_config
from shared.logging import setup_logging

POLICIES = ("cache_aware", "round_robin", "random", "least_load", "power_of_two", "consistent_hash")


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with RouterConfig keys")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--redis-url", dest="redis_url")
    p.add_argument(
        "--worker-url", dest="worker_urls", action="append", help="static worker (repeatable)"
    )
    p.add_argument("--log-level", dest="log_level")


def _up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="number of worker processes")
    p.add_argument("--engine", choices=("sim", "radix"), default="sim")
    p.add_argument(
        "--model", help="local HF model folder (radix engine; default: a tiny random model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router port (0: any free port)")
    p.add_argument("--redis-url", dest="redis_url", help="use this Redis instead of starting one")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument(
        "--cache-tokens", type=int, default=None, help="KV capacity per worker, in tokens"
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=16,
        help="batch size per worker; the router's balance threshold is half of it",
    )
    p.add_argument("--sim-prefill-us-per-token", type=float, default=None)
    p.add_argument("--sim-decode-ms-per-token", type=float, default=None)
    p.add_argument("--model-cache-dir", default=None, help="where the tiny model is built")
    p.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds to wait for each child"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radix-router", description="Cache-aware router for LLM fleets"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_flags(sub.add_parser("serve", help="run the router"))
    _up_flags(sub.add_parser("up", help="start Redis, N workers and the router locally"))
    return parser


def serve_config(args: argparse.Namespace) -> RouterConfig:
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in ("host", "port", "policy", "redis_url", "worker_urls", "log_level")
    }
    return load_config(RouterConfig, args.config, overrides)


def _run_serve(args: argparse.Namespace) -> int:
    from router.app import serve

    config = serve_config(args)
    setup_logging(config.log_level)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config))
    return 0


def _run_up(args: argparse.Namespace) -> int:
    from router.local_fleet import LocalFleet, UpOptions

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    options = UpOptions(
        workers=args.workers, engine=args.engine, model=args.model, host=args.host, port=args.port,
        redis_url=args.redis_url, policy=args.policy, cache_tokens=args.cache_tokens,
        max_running_requests=args.max_running_requests,
        sim_prefill_us_per_token=args.sim_prefill_us_per_token,
        sim_decode_ms_per_token=args.sim_decode_ms_per_token,
        model_cache_dir=args.model_cache_dir, start_timeout=args.start_timeout,
    )  # fmt: skip
    return LocalFleet(options).run()


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
