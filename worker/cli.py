"""`radix-worker`: `serve` a model over HTTP, or `make-tiny-model DIR`.

    radix-worker serve --engine {radix,sim,vllm} --model PATH --host H --port P
                       --redis-url URL [--worker-id ID] [--config FILE] [...]
    radix-worker make-tiny-model DIR [--hidden-size N --layers N ...]

Flags map one to one onto `WorkerConfig` keys (shared/config.py) and win over the
environment (`RADIX_WORKER_<KEY>`) and the YAML file. SIGTERM (or Ctrl-C): leave the
fleet, answer 503 to new requests, finish in-flight ones within `drain_timeout`, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from shared.config import ConfigError, WorkerConfig, load_config
from shared.errors import redact_server_logs
from worker.app import create_app
from worker.backends import build_engine
from worker.state import HEARTBEAT, STATE

log = logging.getLogger("worker")

# (flag, config key, type, help); type None: a switch.
_SERVE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--engine", "engine", str, "radix (ours), sim (cost model, no weights) or vllm"),
    ("--model", "model", str, "local Hugging Face model folder (optional for sim)"),
    ("--served-model-name", "served_model_name", str, "name clients use (default: folder name)"),
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port (0: any free port)"),
    ("--redis-url", "redis_url", str, "Redis for heartbeats (omit to run standalone)"),
    ("--redis-prefix", "redis_prefix", str, "Redis key prefix"),
    ("--worker-id", "worker_id", str, "id in the fleet (default: <hostname>-<port>)"),
    ("--advertise-url", "advertise_url", str, "URL routers dial (default: http://host:port)"),
    ("--heartbeat-interval", "heartbeat_interval", float, "seconds between heartbeats"),
    ("--cache-tokens", "cache_tokens", int, "KV cache capacity in tokens"),
    ("--kv-memory-fraction", "kv_memory_fraction", float, "KV share of free device memory"),
    ("--page-size", "page_size", int, "radix cache page size in tokens"),
    ("--max-running-requests", "max_running_requests", int, "batch size limit; more wait"),
    ("--max-waiting-requests", "max_waiting_requests", int, "queue limit; more get 503"),
    ("--max-prefill-tokens", "max_prefill_tokens", int, "prefill chunk size"),
    ("--max-model-len", "max_model_len", int, "context length cap"),
    ("--device", "device", str, "auto, cpu, cuda, cuda:N"),
    ("--dtype", "dtype", str, "auto, float32, bfloat16, float16"),
    ("--disable-radix-cache", "disable_radix_cache", None, "no prefix caching (ablation)"),
    ("--schedule-policy", "schedule_policy", str, "fcfs or lpm (longest cached prefix first)"),
    ("--no-inflight-sharing", "share_inflight_prefixes", "false", "cache prefixes at finish only"),
    ("--max-n", "max_n", int, "most choices (n) per request"),
    ("--sim-prefill-us-per-token", "sim_prefill_us_per_token", float, "sim: prefill cost"),
    ("--sim-decode-ms-per-token", "sim_decode_ms_per_token", float, "sim: decode cost"),
    ("--api-key", "api_keys", "append", "accepted bearer key (repeatable)"),
    ("--drain-timeout", "drain_timeout", float, "seconds to finish in-flight requests on SIGTERM"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body"),
    ("--log-level", "log_level", str, "DEBUG, INFO, WARNING"),
]


# make-tiny-model flag -> make_tiny_model keyword.
_TINY_FLAGS = {
    "--hidden-size": "hidden_size", "--layers": "num_layers", "--heads": "num_heads",
    "--kv-heads": "num_kv_heads", "--head-dim": "head_dim",
    "--intermediate-size": "intermediate_size", "--vocab-size": "vocab_size",
    "--max-position-embeddings": "max_position_embeddings", "--seed": "seed",
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radix-worker", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("--config", help="YAML file of WorkerConfig keys")
    for flag, key, kind, text in _SERVE_FLAGS:
        if kind is None or kind == "false":
            const = kind is None
            serve.add_argument(flag, dest=key, action="store_const", const=const, help=text)
        elif kind == "append":
            serve.add_argument(flag, dest=key, action="append", help=text)
        else:
            serve.add_argument(flag, dest=key, type=kind, help=text)
    tiny = sub.add_parser("make-tiny-model", help="write a small random-weight model folder")
    tiny.add_argument("dir")
    # Unset flags keep make_tiny_model's own defaults (head_dim 32: vLLM's CPU minimum).
    for flag in _TINY_FLAGS:
        tiny.add_argument(flag, type=int)
    tiny.add_argument("--arch", choices=("llama", "qwen2"))
    return parser


def _url_host(host: str) -> str:
    # A wildcard bind is not dialable; the hostname is (pods, compose services).
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def serve(config: WorkerConfig) -> int:
    # Blocking setup (tokenizers, vLLM args) off the loop; weights load in engine.start().
    engine = await asyncio.to_thread(build_engine, config)
    app = create_app(config, engine)
    state = app[STATE]
    # handler_cancellation: a client that hangs up cancels its handler, which aborts
    # its engine request (non-streaming requests otherwise notice only when answering).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    if state.url is None:
        state.url = f"http://{_url_host(config.host)}:{port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        waiters = [asyncio.ensure_future(state.booted.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if state.failure is not None:
            log.error("engine failed to start: %s", state.failure)
            return 1
        if state.ready.is_set():
            log.info(
                "serving %s on http://%s:%d (engine=%s)",
                state.served_model, config.host, port, config.engine,
            )  # fmt: skip
        await stop.wait()
        log.info("shutting down: leaving the fleet, draining %d in flight", state.inflight)
        state.draining = True
        heartbeat = app.get(HEARTBEAT)
        if heartbeat is not None:
            await heartbeat.leave()
        try:
            await asyncio.wait_for(state.idle.wait(), config.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout: %d requests still in flight are cut", state.inflight)
        return 0
    finally:
        await runner.cleanup()


def _run(config: WorkerConfig) -> int:
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(config))


def _make_tiny_model(args: argparse.Namespace) -> int:
    from worker.engine.tiny_model import make_tiny_model

    given = {kw: getattr(args, flag[2:].replace("-", "_")) for flag, kw in _TINY_FLAGS.items()}
    if args.arch is not None:
        given["arch"] = args.arch
    path = make_tiny_model(args.dir, **{k: v for k, v in given.items() if v is not None})
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-tiny-model":
        return _make_tiny_model(args)
    overrides = {key: getattr(args, key) for _, key, _, _ in _SERVE_FLAGS}
    try:
        config = load_config(WorkerConfig, args.config, overrides)
        logging.basicConfig(
            level=config.log_level.upper(), stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )  # fmt: skip
        redact_server_logs()
        return _run(config)
    except ConfigError as exc:
        print(f"radix-worker: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
