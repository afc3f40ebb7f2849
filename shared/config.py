"""Typed, frozen service configuration: one model per service.

Values come from, in rising precedence: the model defaults, a YAML file, the
environment (`RADIX_ROUTER_<KEY>` / `RADIX_WORKER_<KEY>`), and CLI flags. The Helm
chart renders exactly these YAML files into ConfigMaps, so the keys below are a
contract. Unknown keys and bad values raise `ConfigError` naming the key and where
it came from: in a file and in the environment alike, so a misspelled
`RADIX_ROUTER_CACHE_TRESHOLD` refuses to start, naming the nearest known key, instead
of being ignored. Kubernetes service-link variables (`<NAME>_SERVICE_HOST`,
`<NAME>_PORT_8000_TCP`, ...) are not keys and are left alone.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.wire.peers import check_worker_id, check_worker_url, parse_networks
from shared.wire.service_class import ServiceClass

PolicyName = Literal[
    "cache_aware",
    "cost_aware",
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
]
EngineName = Literal["radix", "sim"]


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A tenant's weight, and the queue's quantum (requests of credit per weight and round),
# bounded so that the fleet queue's credit arithmetic stays finite (router/queue/).
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
MIN_QUANTUM, MAX_QUANTUM = 1e-3, 1e6
# The longest a request may wait in the queue: finite, as its 429's Retry-After is a
# quarter of it in whole seconds (infinity raised OverflowError there: a 500, not a
# 429; 1e300 sent a 301-digit header).
MAX_QUEUE_WAIT_S = 86_400.0


class TenantConfig(_Frozen):
    """One tenant of the fleet queue (router/queue/): named by its API keys, served in
    proportion to `weight`, refused with 429 past its own bounds (unset: the router's
    `max_queue` and `queue_timeout`)."""

    keys: tuple[str, ...] = Field(min_length=1)
    # A share beside the other tenants': finite, and within MIN_WEIGHT..MAX_WEIGHT, as the
    # queue's credit arithmetic needs (a weight of 1e-320 overflowed its new-round count,
    # credit / (weight x quantum), to infinity: the queue raised on every freed seat).
    weight: float = Field(1.0, gt=0, le=MAX_WEIGHT, allow_inf_nan=False)
    max_queue: int | None = Field(None, ge=0)
    max_queue_wait_s: float | None = Field(None, gt=0, le=MAX_QUEUE_WAIT_S)

    @field_validator("weight")
    @classmethod
    def _weight_floor(cls, v: float) -> float:
        if v < MIN_WEIGHT:
            raise ValueError(f"must be at least {MIN_WEIGHT} (a share beside the others')")
        return v


class ClassConfig(_Frozen):
    """A request class's time-to-first-token objective (router/queue/classes.py)."""

    ttft_slo_s: float = Field(gt=0)


class ClassesConfig(_Frozen):
    interactive: ClassConfig = ClassConfig(ttft_slo_s=1.0)
    standard: ClassConfig = ClassConfig(ttft_slo_s=10.0)
    batch: ClassConfig = ClassConfig(ttft_slo_s=120.0)


class RouterConfig(_Frozen):
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    policy: PolicyName = "cache_aware"
    # Discovery: Redis heartbeats and/or a static list.
    redis_url: str | None = None
    redis_prefix: str = "radixrouter:"
    worker_urls: tuple[str, ...] = ()
    discovery_interval: float = Field(1.0, gt=0)
    # After a Redis outage, workers absent from the registry are kept this long (they
    # re-register on their next heartbeat).
    reconnect_grace: float = Field(5.0, ge=0)
    # cache_aware: see router/policy/cache_aware.py for the rule these thresholds drive.
    cache_threshold: float = Field(0.3, ge=0, le=1)
    # A load gap (requests) that counts as imbalance. 64 suits GPU workers that run
    # hundreds of requests at once; set it to about half of what one worker runs at once
    # (e.g. 4 for CPU sim workers at 8): when it never fires, a prefix every request shares
    # (one system prompt) pulls all traffic to one worker (loadtests/results/policies.md).
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    balance_mode: Literal["fleet", "per_request"] = "fleet"
    no_match: Literal["least_load", "smallest_tree"] = "least_load"
    tree_max_chars: int = Field(200_000_000, gt=0)
    # The workers' tokenizer's characters per token (English BPE about 4; the sim workers'
    # word tokenizer 2.5): sizes the tree caps, and cost_aware's token counts, which it
    # weighs against the queues workers report in their own tokens.
    tree_chars_per_token: float = Field(4.0, gt=0)
    # The workers' tokenizer (shared/tokens/prompt_tokens.py): a local model or tokenizer folder,
    # or "sim" (the sim engine's). Set, the router computes each request's prompt ids as
    # the worker does: the policies' trees key on them (matches and caps in tokens) and
    # the KV-event index is looked up with them.
    tokenizer: str | None = None
    # The workers' context length in tokens (None: the tokenizer folder's config.json
    # `max_position_embeddings`). Prompts over it × 16 characters are not tokenized: they
    # are routed on their text and the worker refuses them (router/http/tokenize.py).
    max_prompt_tokens: int | None = Field(None, gt=0)
    # KV events (router/holdings/kv_feed.py): read every worker's KV-event stream into an exact
    # block index beside the tree (needs redis_url and tokenizer). A routed request's tree
    # entry still counts for `kv_events_inflight` seconds (its KV is on its way); a worker
    # whose stream has a gap or lags by over `kv_events_max_lag` s is routed on the tree.
    kv_events: bool = False
    kv_events_max_blocks: int = Field(2_000_000, ge=1)
    # Tokens per block of the workers' KV events (0: the size most of a model's workers
    # name in their heartbeats); entries past `kv_events_stream_len` are trimmed by routers.
    kv_events_block_size: int = Field(0, ge=0, le=4096)
    kv_events_stream_len: int = Field(10_000, ge=100)
    kv_events_max_lag: float = Field(2.0, gt=0)
    kv_events_inflight: float = Field(2.0, ge=0)
    # What a block a worker reports on its host tier (medium "CPU") is worth against one
    # on its device, 0..1 (router/holdings/merge.py): unset, each worker's own figures
    # (1 - host load time / prefill time of a token, from its heartbeat; 0.5 without
    # them); 0 counts host-held blocks as misses, 1 as device hits.
    kv_events_host_weight: float | None = Field(None, ge=0, le=1)
    # cost_aware (router/cost_aware.py): what a prefill token and a decode step cost on a
    # worker whose heartbeat reports neither, and how many decode steps each request in a
    # worker's load delays a new one's first token.
    cost_prefill_us_per_token: float = Field(50.0, gt=0)
    cost_decode_ms_per_token: float = Field(10.0, gt=0)
    cost_decode_weight: float = Field(1.0, ge=0)
    # How many times a request's own uncached tokens count (1: its time to first token).
    cost_miss_weight: float = Field(1.0, ge=0)
    # How many times each request running on a worker counts a new request's uncached
    # prefill, which stalls its next token (1: once; 0: cost_aware before 2026-12-01).
    cost_stall_weight: float = Field(1.0, ge=0)
    # A holder of the longest match keeps a request unless another worker is predicted
    # faster by more than this many of its seat intervals (request_ms / seats; 0: off).
    cost_hold_margin: float = Field(1.0, ge=0)
    session_header: str = "x-session-id"
    # prompt_cache_key sessions (router/holdings/sessions.py): entries kept, and seconds an
    # entry lives after its last use.
    session_table_max: int = Field(100_000, ge=1)
    session_ttl: float = Field(3600.0, gt=0)
    # Proxy.
    connect_timeout: float = Field(5.0, gt=0)
    request_timeout: float = Field(600.0, gt=0)
    max_retries: int = Field(2, ge=0)
    retry_backoff: float = Field(0.05, ge=0)
    breaker_failures: int = Field(3, ge=1)
    breaker_cooldown: float = Field(10.0, gt=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    # Slow peers (shared/serving/body.py, router/upstream/proxy.py): a body must arrive within
    # body_read_timeout, before it may take an admission slot; a stream write to a client
    # that blocks longer than stream_write_timeout aborts the stream and its upstream
    # request, so the worker frees its slot and KV.
    body_read_timeout: float = Field(30.0, gt=0)
    stream_write_timeout: float = Field(30.0, gt=0)
    # A connection whose request head (line and headers) is not complete this long after
    # it opened, or after the first byte of a later request, is closed (shared/serving/http_server.py).
    header_read_timeout: float = Field(10.0, gt=0)
    # The simplest inference requests served by the router's own protocol, everything else
    # by aiohttp's (router/http/fast_server.py; ~10% less CPU a request); both pass one
    # conformance suite. False: aiohttp's server for every request.
    fast_hot_paths: bool = True
    # A non-streamed worker answer larger than this is refused with 502, never buffered.
    max_response_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # All non-streamed answers being read at once hold at most this many bytes; an answer
    # that would go over is refused with 503 "overloaded" (router/upstream/transport.py).
    max_buffered_answer_bytes: int = Field(256 * 1024 * 1024, gt=0)
    # The inference path's HTTP client (router/upstream/transport.py): the project's own
    # ("own", less CPU per request) or aiohttp's; both pass one conformance suite.
    upstream_client: Literal["own", "aiohttp"] = "own"
    # The fleet queue (router/queue/): at most `max_concurrent` requests in flight through
    # this router; a request with no free seat waits in the router, each tenant at most
    # `max_queue` waiting and `queue_timeout` seconds (its own bounds in `tenants`).
    max_concurrent: int = Field(1024, ge=1)
    max_queue: int = Field(4096, ge=0)
    queue_timeout: float = Field(30.0, gt=0, le=MAX_QUEUE_WAIT_S)
    # Tenants by API key (keys in `api_keys` and none: the tenant "default").
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # Each class's TTFT objective (a class comes from `service_tier` or `priority`).
    classes: ClassesConfig = ClassesConfig()
    # A worker's seats: `max_running_requests` m from its heartbeat + this many spare
    # seats (a worker reporting none has unbounded seats: nothing waits for it). One
    # spare keeps the engine's next request waiting in it, so no engine step runs a slot
    # short while the router answers the end of one request with the next; a fixed
    # count, not a share of m, so at m = 256 the router still orders all but one of a
    # worker's queued requests (loadtests/results/fleet_queue.md, "Final state").
    queue_spare_seats: int = Field(1, ge=0)
    # Deficit round robin: each round gives a backlogged tenant weight x this many
    # requests of credit; it is also how far locality may run ahead of fairness.
    queue_quantum: float = Field(4.0, ge=MIN_QUANTUM, le=MAX_QUANTUM)
    # A waiting request is urgent once this fraction of its class's TTFT objective has
    # passed: it then takes any free seat, ahead of affinity.
    queue_urgent_fraction: float = Field(0.5, gt=0, le=1)
    # Replicas (sync on): each grows its count on a worker by at most this share of the
    # worker's `max_running_requests` (at least 1) above the least it held there over
    # the last three `sync_load_interval`s, so N replicas hold at most
    # seats + (N - 1) x that share (router/queue/seats.py).
    queue_replica_slack: float = Field(0.25, gt=0, le=1)
    forward_authorization: bool = False
    drain_timeout: float = Field(30.0, ge=0)
    # After SIGTERM, keep serving (readiness 503) this long before refusing new requests,
    # so load balancers stop sending first; then drain. The chart sets it.
    shutdown_delay: float = Field(0.0, ge=0)
    # One log line per request (shared/serving/access_log.py); about 20 µs of CPU each.
    access_log: bool = True
    # Security.
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    protect_metrics: bool = False
    # Sent to workers as their Bearer key (it must be in each worker's api_keys).
    worker_api_key: str | None = None
    # Worker URLs from Redis or the admin API must resolve into one of these networks
    # (e.g. the pod CIDR); empty: any address but link-local and metadata ones.
    worker_url_allow_cidrs: tuple[str, ...] = ()
    # Per-client token bucket on inference requests (router/http/ratelimit.py); None: off.
    rate_limit_per_key: float | None = Field(None, gt=0)
    rate_limit_burst: int = Field(20, ge=1)
    # With a Redis URL the limit is shared by every replica (one Lua script per request);
    # a Redis that does not answer within this many seconds falls back to per replica.
    rate_limit_redis_timeout: float = Field(0.25, gt=0)
    # CIDRs of load balancers / ingress whose X-Forwarded-For names the client (rate limit).
    trusted_proxies: tuple[str, ...] = ()
    # Several replicas share routing decisions and in-flight load through Redis (router/holdings/sync.py).
    sync: bool = False
    # Router processes on this host behind one port (SO_REUSEPORT; router/up/processes.py).
    # Above 1 they route as replicas: sync is turned on when redis_url is set.
    processes: int = Field(1, ge=1, le=256)
    # About this many decisions stay in the sync stream (replayed by a replica that
    # starts): an entry is one replica's flush of up to 256 decisions, and each replica
    # trims to this many / the decisions an entry held of late, never under 100 entries
    # (router/holdings/sync.py): Redis holds about what this many decisions take.
    sync_stream_maxlen: int = Field(20_000, ge=100)
    # The longest key shared per decision: chars of text, or token ids with a `tokenizer`.
    sync_max_chars: int = Field(32_768, ge=64)
    sync_flush_interval: float = Field(0.02, gt=0)
    sync_load_interval: float = Field(0.25, gt=0)
    log_level: str = "INFO"

    @field_validator("tenants")
    @classmethod
    def _tenant_keys(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        owner: dict[str, str] = {}
        for name, tenant in v.items():
            for i, key in enumerate(tenant.keys):
                if key in owner:
                    raise ValueError(
                        f"tenants.{name}.keys[{i}] is also a key of tenant {owner[key]!r}"
                    )
                owner[key] = name
        return v

    @field_validator("worker_urls")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_worker_url(u) for u in v)

    @model_validator(mode="after")
    def _kv_events_inputs(self) -> RouterConfig:
        if self.kv_events and not (self.redis_url and self.tokenizer):
            raise ValueError("kv_events needs redis_url (the streams) and tokenizer (the ids)")
        return self

    @field_validator("worker_url_allow_cidrs", "trusted_proxies")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        parse_networks(v)  # ValueError names the bad network
        return v


class WorkerConfig(_Frozen):
    host: str = "0.0.0.0"
    port: int = Field(8001, ge=0, le=65535)
    worker_id: str | None = None  # default: <hostname>-<port>
    advertise_url: str | None = None  # what routers dial; default http://<host>:<port>
    engine: EngineName = "radix"
    model: str | None = None  # local HF folder; optional for the sim engine
    served_model_name: str | None = None
    redis_url: str | None = None
    # The Redis password, read from this file at connect time (the chart mounts each pod's
    # own credential here), so it appears in no URL, environment or ConfigMap.
    redis_password_file: str | None = None
    redis_prefix: str = "radixrouter:"
    heartbeat_interval: float = Field(1.0, gt=0)
    heartbeat_ttl_intervals: int = Field(3, ge=2)
    # KV-cache events (worker/kv_publisher.py): every block the radix cache stores or drops,
    # in vLLM's schema, onto this worker's bounded Redis stream for routers' exact index.
    kv_events: bool = False
    kv_events_block_size: int = Field(16, ge=1, le=4096)
    kv_events_stream_len: int = Field(10_000, ge=100)  # entries kept (MAXLEN ~)
    kv_events_interval: float = Field(0.05, gt=0)  # seconds between stream writes
    # Engine.
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "sdpa", "triton"] = "auto"  # auto: triton on CUDA
    # KV pool storage: auto (the activations' dtype) or fp8_e4m3 (per-tensor scales;
    # twice the tokens per pool, half the KV bytes a decode step reads).
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    disable_cuda_graph: bool = False
    # Steps with a prefill chunk of up to this many tokens replay piecewise CUDA graphs
    # (attention eager between them; worker/engine/runtime/piecewise_graphs.py). 0: off,
    # the default until a GPU run has checked them. disable_cuda_graph turns them off too.
    piecewise_cuda_graph_max_tokens: int = Field(0, ge=0, le=16384, strict=True)
    # Schedule step N+1 while step N runs on the device (worker/engine/engine.py).
    disable_overlap_schedule: bool = False
    cache_tokens: int | None = Field(None, gt=0)  # KV capacity; None: kv_memory_fraction
    kv_memory_fraction: float = Field(0.5, gt=0, le=0.95)
    page_size: int = Field(1, ge=1)
    # Host KV tier under the radix cache, in tokens (0: off): evicted device pages stay
    # cached in host memory (pinned on CUDA) and are loaded back on a hit. The pod needs
    # that much memory on top of the weights (worker/engine/runtime/host_pool.py).
    host_cache_tokens: int = Field(0, ge=0, strict=True)
    # Pins across tool gaps (worker/engine/pins.py): at most this fraction of the KV
    # cache pinned (0: pins off; outside [0, 1] the worker refuses to start), a pin's
    # TTL clamped to pin_max_ttl_s, and pin_default_ttl_s for a request that sends a
    # prompt_cache_key but no cache_pin_ttl (0: such requests pin nothing).
    pin_budget: float = Field(0.25, ge=0, le=1)
    pin_max_ttl_s: float = Field(300.0, ge=0)
    pin_default_ttl_s: float = Field(0.0, ge=0)
    # The radix cache's aged second chance for reused prefixes (worker/engine/
    # second_chance.py): the fraction of KV granted nodes may hold (0: plain LRU).
    second_chance: float = Field(0.1, ge=0, le=1)
    # The same per class (shared/wire/service_class.py), e.g. {interactive: 120, batch: 0}:
    # a class named here takes its TTL instead of pin_default_ttl_s.
    pin_class_ttl_s: dict[ServiceClass, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    host_write_policy: Literal["write_back", "write_through"] = "write_back"
    max_running_requests: int = Field(64, ge=1)
    max_prefill_tokens: int = Field(2048, ge=16)
    max_model_len: int | None = Field(None, gt=0)
    max_waiting_requests: int = Field(1024, ge=0)
    disable_radix_cache: bool = False
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    share_inflight_prefixes: bool = True  # prefill chunks enter the tree while running
    max_n: int = Field(8, ge=1, le=128)  # most choices (`n`) one request may ask for
    # Sim engine cost model (worker/backends/sim.py): every step costs decode_ms (one
    # pass over the weights), plus decode_us_per_seq per sequence in it, plus
    # decode_us_per_1k_context per 1,000 context tokens its sequences read, plus
    # prefill_us per prompt token it computes.
    sim_prefill_us_per_token: float = Field(0.0, ge=0)
    sim_decode_ms_per_token: float = Field(0.0, ge=0)
    sim_decode_us_per_seq: float = Field(0.0, ge=0)
    sim_decode_us_per_1k_context: float = Field(0.0, ge=0)
    # HTTP.
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    body_read_timeout: float = Field(30.0, gt=0)  # as the router's
    header_read_timeout: float = Field(10.0, gt=0)  # as the router's
    stream_write_timeout: float = Field(30.0, gt=0)  # then the request is aborted
    api_keys: tuple[str, ...] = ()
    drain_timeout: float = Field(30.0, ge=0)
    # After SIGTERM the worker leaves the registry at once but keeps serving this long
    # (routers drop it within a discovery interval), then refuses new requests and drains.
    shutdown_delay: float = Field(0.0, ge=0)
    access_log: bool = True
    log_level: str = "INFO"

    @field_validator("engine", mode="before")
    @classmethod
    def _retired(cls, v: object) -> object:
        if v == "vllm":
            raise ValueError(
                "the in-process vllm engine is retired: run `vllm serve` and make it a "
                "worker with `radix-worker attach --engine vllm` (worker/attach/sidecar.py)"
            )
        return v

    @field_validator("advertise_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else check_worker_url(v)

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, v: str | None) -> str | None:
        # Refused here, not only by every router reading the registry: a worker with an
        # id routers drop would heartbeat happily and never get a request.
        return None if v is None else check_worker_id(v)

    @field_validator("redis_password_file")
    @classmethod
    def _password_file(cls, v: str | None) -> str | None:
        if v is not None:
            read_password_file(v)  # ValueError: missing, unreadable or empty
        return v

    @model_validator(mode="after")
    def _one_password(self) -> WorkerConfig:
        if self.redis_password_file is not None:
            if not self.redis_url:
                raise ValueError("redis_password_file needs redis_url")
            if urlsplit(self.redis_url).password is not None:
                raise ValueError("redis_url has a password and redis_password_file is set")
        return self


def read_password_file(path: str) -> str:
    """The password in a file (one line; a trailing newline is dropped). ValueError names
    the file when it is missing, unreadable, empty or more than one line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4097)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read password file {path}: {exc}") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password or len(password) > 4096 or any(c in password for c in "\r\n"):
        raise ValueError(f"password file {path} must hold one non-empty line")
    return password


ConfigT = TypeVar("ConfigT", bound=_Frozen)

ENV_PREFIXES: dict[type[_Frozen], str] = {
    RouterConfig: "RADIX_ROUTER_",
    WorkerConfig: "RADIX_WORKER_",
}


# What Kubernetes injects for a Service whose name shares the prefix (the Helm chart
# turns service links off; a pod spec written by hand may not).
_SERVICE_LINK = re.compile(
    r"_SERVICE_(HOST|PORT)(_[A-Z0-9_]+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_(ADDR|PORT|PROTO))?$"
)


def _check_env_keys(model: type[_Frozen], environ: Mapping[str, str]) -> None:
    """ConfigError for a variable with the service's prefix that names no key."""
    prefix = ENV_PREFIXES[model]
    known = sorted(prefix + name.upper() for name in model.model_fields)
    for key in sorted(environ):
        if key.startswith(prefix) and key not in known and not _SERVICE_LINK.search(key):
            near = difflib.get_close_matches(key, known, 1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(
                f"unknown environment key {key}{hint} (every {prefix}* variable must name a "
                f"{model.__name__} key, shared/config.py)"
            )


def _from_env(model: type[_Frozen], environ: Mapping[str, str]) -> dict[str, Any]:
    prefix = ENV_PREFIXES[model]
    _check_env_keys(model, environ)
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = environ.get(prefix + name.upper())
        if raw is None:
            continue
        is_seq = "tuple" in str(field.annotation)
        # Lists come as "a,b" or a YAML list; scalars as YAML so "1.5" and "true" parse.
        if is_seq and not raw.lstrip().startswith("["):
            out[name] = [p.strip() for p in raw.split(",") if p.strip()]
        else:
            try:
                out[name] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                out[name] = raw
            if isinstance(out[name], (dict, list)) and not is_seq:
                out[name] = raw
    return out


def _read_file(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys, not {type(data).__name__}"
        )
    return data


def load_config(
    model: type[ConfigT],
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConfigT:
    """Merge defaults < file < environment < overrides (CLI flags; None values skipped)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    lines: yaml.Node | None = None
    if file is not None:
        layers.append((f"file {file}", _read_file(file)))
        lines = yaml.compose(Path(file).read_text())
    layers.append(("environment", _from_env(model, os.environ if environ is None else environ)))
    layers.append(("flags", {k: v for k, v in (overrides or {}).items() if v is not None}))
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for where, values in layers:
        for key, value in values.items():
            merged[key] = value
            source[key] = where
    try:
        return model.model_validate(merged)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(root)"
            top = str(err["loc"][0]) if err["loc"] else ""
            where = source.get(top, "defaults")
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            if lines is not None and where.startswith("file "):
                # A check over several entries names the entry at fault in its message.
                named = _NAMED_PATH.match(msg.removeprefix("Value error, "))
                loc = _path_loc(named.group(1)) if named else err["loc"]
                line = _line_of(lines, loc)
                where += "" if line is None else f", line {line}"
            problems.append(f"{key}: {msg} (from {where})")
        raise ConfigError(f"invalid {model.__name__}: " + "; ".join(problems)) from None


_NAMED_PATH = re.compile(r"([A-Za-z_]\w*(?:\.\w+|\[\d+\])+) ")


def _path_loc(path: str) -> tuple[str | int, ...]:
    """ "tenants.b.keys[1]" -> ("tenants", "b", "keys", 1)."""
    return tuple(int(p) if p.isdigit() else p for p in re.findall(r"\w+", path))


def _line_of(node: yaml.Node, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the YAML entry at `loc` (the deepest one found)."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next((kv for kv in node.value if kv[0].value == str(part)), None)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def dump_config(config: _Frozen) -> str:
    """The YAML a service would load to get exactly this config (used by `up` and Helm tests)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
