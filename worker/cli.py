"""`radix-worker`: `serve` a model over HTTP, or `make-tiny-model DIR`.

    radix-worker serve --engine {radix,sim} --model PATH --host H --port P
                       --redis-url URL [--worker-id ID] [--config FILE] [...]
    radix-worker make-tiny-model DIR [--preset P] [--hidden-size N --layers N ...]

Flags map one to one onto `WorkerConfig` keys (shared/config.py) and win over the
environment (`RADIX_WORKER_<KEY>`) and the YAML file. SIGTERM (or Ctrl-C): leave the
fleet, answer 503 to new requests, finish in-flight ones within `drain_timeout`, exit 0
(worker/http/server.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from shared.config import ConfigError, WorkerConfig, load_config
from shared.serving.logging import setup_logging
from worker.backends import build_engine
from worker.http import server
from worker.models.model_presets import ARCHS, PRESETS

SERVE_DESCRIPTION = """Serve a model over the OpenAI HTTP API (/v1/chat/completions, /v1/completions,
/generate) with a radix KV cache, and heartbeat into Redis so routers find it.
Every WorkerConfig key (shared/config.py) can also be set in --config FILE or as
RADIX_WORKER_<KEY>; flags win over the environment, which wins over the file."""

# (flag, config key, type, help); type None: a switch. The help gets the default appended.
_SERVE_FLAGS: list[tuple[str, str, Any, str]] = [
    (
        "--engine",
        "engine",
        str,
        "radix (ours, on --model) or sim (a cost model: no weights, no torch)",
    ),
    ("--model", "model", str, "local Hugging Face model folder (optional for sim)"),
    ("--served-model-name", "served_model_name", str, "name clients use (default: folder name)"),
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port; 0: any free port"),
    ("--redis-url", "redis_url", str, "Redis for heartbeats (omit to run standalone)"),
    ("--redis-password-file", "redis_password_file", str, "file holding the Redis password"),
    ("--redis-prefix", "redis_prefix", str, "Redis key prefix"),
    ("--worker-id", "worker_id", str, "id in the fleet (default: <hostname>-<port>)"),
    ("--advertise-url", "advertise_url", str, "URL routers dial (default: http://host:port)"),
    ("--heartbeat-interval", "heartbeat_interval", float, "seconds between heartbeats to Redis"),
    (
        "--cache-tokens",
        "cache_tokens",
        int,
        "KV cache capacity in tokens (unset: --kv-memory-fraction of free memory)",
    ),
    (
        "--kv-memory-fraction",
        "kv_memory_fraction",
        float,
        "share of free device memory for the KV cache, 0-0.95",
    ),
    ("--page-size", "page_size", int, "radix cache page size in tokens"),
    ("--kv-events", "kv_events", None, "publish KV-cache events to Redis for routers' index"),
    ("--kv-events-block-size", "kv_events_block_size", int, "tokens per block in KV events"),
    (
        "--host-cache-tokens",
        "host_cache_tokens",
        int,
        "host-memory KV tier under the radix cache, in tokens (0: off)",
    ),
    (
        "--host-write-policy",
        "host_write_policy",
        str,
        "write_back (copy a page to host when evicted) or write_through (when cached)",
    ),
    (
        "--max-running-requests",
        "max_running_requests",
        int,
        "requests run at once (the batch); more wait in the queue",
    ),
    (
        "--max-waiting-requests",
        "max_waiting_requests",
        int,
        "requests waiting at most; more are refused with 503",
    ),
    ("--max-prefill-tokens", "max_prefill_tokens", int, "prefill chunk size, in tokens"),
    ("--max-model-len", "max_model_len", int, "context length cap, in tokens (unset: the model's)"),
    ("--device", "device", str, "auto, cpu, cuda, cuda:N"),
    ("--dtype", "dtype", str, "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16"),
    ("--attention-backend", "attention_backend", str, "auto (CUDA: triton), sdpa, triton"),
    (
        "--kv-cache-dtype",
        "kv_cache_dtype",
        str,
        "KV cache storage: auto (the model dtype) or fp8_e4m3 (per-tensor scales, 2x tokens)",
    ),
    (
        "--disable-cuda-graph",
        "disable_cuda_graph",
        None,
        "run every step eagerly on CUDA (decode graphs and piecewise graphs off)",
    ),
    (
        "--piecewise-cuda-graph-max-tokens",
        "piecewise_cuda_graph_max_tokens",
        int,
        "piecewise CUDA graphs for steps with a prefill chunk of up to this many tokens (0: off)",
    ),
    (
        "--disable-overlap-schedule",
        "disable_overlap_schedule",
        None,
        "schedule each step after the previous one finished (no host/device overlap)",
    ),
    ("--disable-radix-cache", "disable_radix_cache", None, "no prefix caching (ablation)"),
    ("--schedule-policy", "schedule_policy", str, "fcfs, or lpm: longest cached prefix first"),
    (
        "--no-inflight-sharing",
        "share_inflight_prefixes",
        "false",
        "prefixes enter the radix cache when a request ends, not per prefill chunk (ablation)",
    ),
    ("--max-n", "max_n", int, "most choices (n) one request may ask for"),
    (
        "--sim-prefill-us-per-token",
        "sim_prefill_us_per_token",
        float,
        "sim engine: prefill cost, microseconds per uncached prompt token",
    ),
    (
        "--sim-decode-ms-per-token",
        "sim_decode_ms_per_token",
        float,
        "sim engine: decode cost, milliseconds per output token",
    ),
    (
        "--sim-decode-us-per-seq",
        "sim_decode_us_per_seq",
        float,
        "sim engine: decode step cost per sequence in the batch, microseconds",
    ),
    (
        "--sim-decode-us-per-1k-context",
        "sim_decode_us_per_1k_context",
        float,
        "sim engine: decode step cost per 1,000 context tokens read (the KV), microseconds",
    ),
    ("--pin-budget", "pin_budget", float, "pins across tool gaps: fraction of KV, 0-1 (0: off)"),
    (
        "--second-chance",
        "second_chance",
        float,
        "radix cache: fraction of KV reused prefixes' second chances may hold, 0-1 (0: LRU)",
    ),
    ("--pin-max-ttl-s", "pin_max_ttl_s", float, "longest pin TTL granted; longer is clamped"),
    (
        "--pin-default-ttl-s",
        "pin_default_ttl_s",
        float,
        "pin TTL for a request with a prompt_cache_key and no cache_pin_ttl (0: none)",
    ),
    ("--api-key", "api_keys", "append", "accepted bearer key (repeatable)"),
    ("--drain-timeout", "drain_timeout", float, "seconds to finish in-flight requests on SIGTERM"),
    (
        "--shutdown-delay",
        "shutdown_delay",
        float,
        "on SIGTERM: seconds to keep serving after leaving Redis",
    ),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body, in bytes"),
    ("--log-level", "log_level", str, "DEBUG, INFO, WARNING"),
]


# make-tiny-model flag -> make_tiny_model keyword.
_TINY_FLAGS = {
    "--hidden-size": "hidden_size", "--layers": "num_layers", "--heads": "num_heads",
    "--kv-heads": "num_kv_heads", "--head-dim": "head_dim",
    "--intermediate-size": "intermediate_size", "--vocab-size": "vocab_size",
    "--max-position-embeddings": "max_position_embeddings", "--seed": "seed",
    "--num-shards": "num_shards",
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radix-worker", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP", description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    serve.add_argument("--config", metavar="FILE", help="YAML file of WorkerConfig keys")
    for flag, key, kind, described in _SERVE_FLAGS:
        default = WorkerConfig.model_fields[key].default
        plain = default in (None, ()) or kind == "false"
        text = described if plain else f"{described} (default {default})"
        if kind is None or kind == "false":  # a switch that sets True, or False
            const = kind is None
            serve.add_argument(flag, dest=key, action="store_const", const=const, help=text)
        elif kind == "append":
            serve.add_argument(flag, dest=key, action="append", help=text)
        else:
            serve.add_argument(flag, dest=key, type=kind, help=text)
    tiny = sub.add_parser(
        "make-tiny-model", help="write a random-weight model folder",
        description="Write a Llama-family model with random weights and a byte-level "
        "BPE tokenizer with a chat template into DIR, made locally (nothing is downloaded): "
        "small by default, or a real model's shape (--preset). Its text is random; its KV "
        "cache, batching and prefix caching are real.",
    )  # fmt: skip
    tiny.add_argument("dir", metavar="DIR", help="folder to write (created if missing)")
    tiny.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                      help="shape: tiny (tests), bench, or a real model's (random weights)")  # fmt: skip
    # Unset flags keep the preset's values (tiny's head_dim 32: vLLM's CPU minimum).
    for flag in _TINY_FLAGS:
        tiny.add_argument(flag, type=int, metavar="N", help="(default: the preset's)")
    tiny.add_argument("--arch", choices=ARCHS, help="(default: the preset's, else llama)")
    tiny.add_argument("--device", help="draw the weights here (default cpu; cuda is faster)")
    tiny.add_argument("--dtype", help="weights dtype on disk (default float32)")
    down = sub.add_parser(
        "download", help="fetch a Hugging Face model into a folder (the chart's init container)",
        description="Download MODEL (a Hugging Face repo id) at --revision into --dir with "
        "huggingface_hub (HF_ENDPOINT for a mirror, HF_TOKEN for gated models). "
        "A MODEL that is a local folder is used as is.",
    )  # fmt: skip
    down.add_argument("model", metavar="MODEL", help="repo id, e.g. Qwen/Qwen2.5-7B-Instruct")
    down.add_argument("--revision", help="commit, tag or branch (default main; pin it)")
    down.add_argument("--dir", required=True, help="target folder (the model cache volume)")
    from worker.attach.command import add_attach_parser

    add_attach_parser(sub)
    return parser


def _make_tiny_model(args: argparse.Namespace) -> int:
    from worker.models.tiny_model import make_tiny_model

    given = {kw: getattr(args, flag[2:].replace("-", "_")) for flag, kw in _TINY_FLAGS.items()}
    given |= {"arch": args.arch, "device": args.device, "dtype": args.dtype}
    kwargs = PRESETS[args.preset] | {k: v for k, v in given.items() if v is not None}
    path = make_tiny_model(args.dir, **kwargs)
    print(path)
    return 0


def _download(args: argparse.Namespace) -> int:
    from worker.download import DownloadError, download

    logging.basicConfig(
        level="INFO", stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        done = download(args.model, args.dir, args.revision)
    except DownloadError as exc:
        print(f"radix-worker download: {exc}", file=sys.stderr)
        return 1
    state = "fetched" if done.fetched else "already present"
    print(f"{done.path} ({args.model} at {done.commit or 'local folder'}, {state})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-tiny-model":
        return _make_tiny_model(args)
    if args.command == "download":
        return _download(args)
    if args.command == "attach":
        from worker.attach.command import run_attach

        return run_attach(args)
    overrides = {key: getattr(args, key) for _, key, _, _ in _SERVE_FLAGS}
    try:
        config = load_config(WorkerConfig, args.config, overrides)
        setup_logging(config.log_level)
        return server.run(config, build_engine)
    except ConfigError as exc:
        print(f"radix-worker: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
