"""`radix-worker attach`'s command line: its flags, their checks (exit 2 with one line
naming the flag), then the sidecar (worker/attach/sidecar.py) until SIGTERM or Ctrl-C.
Secrets stay out of the process list: the Redis URL and password file default to
`RADIX_WORKER_REDIS_URL` / `RADIX_WORKER_REDIS_PASSWORD_FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Any

from shared.config import read_password_file
from shared.wire.peers import check_worker_id, check_worker_url
from worker.attach import sidecar
from worker.attach.sidecar import AttachConfig


def add_attach_parser(sub: Any) -> None:
    p = sub.add_parser(
        "attach", help="register a stock SGLang or vLLM server as a worker (a sidecar)",
        description=sidecar.__doc__.split("\n\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument(
        "--upstream", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--engine", required=True, choices=("sglang", "vllm"))
    p.add_argument(
        "--redis-url", default=os.environ.get("RADIX_WORKER_REDIS_URL"),
        help="Redis of the fleet (default: $RADIX_WORKER_REDIS_URL, which keeps a password "
        "out of the process list)",
    )  # fmt: skip
    p.add_argument(
        "--redis-password-file", default=os.environ.get("RADIX_WORKER_REDIS_PASSWORD_FILE"),
        help="file holding the Redis password (default: $RADIX_WORKER_REDIS_PASSWORD_FILE); "
        "the URL then names only the user",
    )  # fmt: skip
    p.add_argument("--worker-id", help="id in the fleet (default: the hostname)")
    p.add_argument("--advertise-url", help="URL routers dial (default: --upstream)")
    p.add_argument("--served-model-name", help="model name (default: the upstream's /v1/models)")
    p.add_argument("--redis-prefix", default="radixrouter:")
    p.add_argument(
        "--kv-events", metavar="ENDPOINT",
        help="the engine's ZMQ KV-event publisher, e.g. tcp://127.0.0.1:5557 (vLLM "
        "--kv-events-config endpoint): forwarded to this worker's Redis stream",
    )  # fmt: skip
    p.add_argument(
        "--kv-events-replay", metavar="ENDPOINT",
        help="the publisher's replay socket (vLLM replay_endpoint), asked on a gap",
    )  # fmt: skip
    p.add_argument(
        "--max-running-requests", type=int, default=0, metavar="N",
        help="the engine's batch cap (vLLM --max-num-seqs, SGLang --max-running-requests): "
        "the router's seats for it; unset, the router never holds requests back from it",
    )  # fmt: skip
    p.add_argument(
        "--priority-scheduling", action="store_true",
        help="the engine runs vLLM's --scheduling-policy priority: routers add each "
        "request's class as its integer `priority`",
    )  # fmt: skip
    p.add_argument("--interval", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--log-level", default="INFO")


def run_attach(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    try:
        upstream = check_worker_url(args.upstream)
        advertise = check_worker_url(args.advertise_url or args.upstream)
        # Routers drop a record whose id has another shape: refuse it here, loudly.
        worker_id = check_worker_id(args.worker_id or socket.gethostname())
    except ValueError as exc:
        print(f"radix-worker attach: {exc}", file=sys.stderr)
        return 2
    if not args.redis_url:
        print(
            "radix-worker attach: --redis-url (or RADIX_WORKER_REDIS_URL) is required",
            file=sys.stderr,
        )
        return 2
    if args.redis_password_file:
        try:
            read_password_file(args.redis_password_file)
        except ValueError as exc:
            print(f"radix-worker attach: --redis-password-file: {exc}", file=sys.stderr)
            return 2
    if args.interval <= 0:
        print("radix-worker attach: --interval must be > 0", file=sys.stderr)
        return 2
    if args.max_running_requests < 0:
        print("radix-worker attach: --max-running-requests must be >= 0", file=sys.stderr)
        return 2
    config = AttachConfig(
        upstream=upstream, engine=args.engine, redis_url=args.redis_url,
        worker_id=worker_id, advertise_url=advertise,
        redis_prefix=args.redis_prefix, redis_password_file=args.redis_password_file,
        served_model_name=args.served_model_name,
        interval=args.interval, kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
        max_running_requests=args.max_running_requests,
        priority_scheduling=args.priority_scheduling,
    )  # fmt: skip

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await sidecar.attach(config, stop)

    asyncio.run(main())
    return 0
