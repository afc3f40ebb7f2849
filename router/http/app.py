"""`create_app(config) -> web.Application`: the router service, assembled once.

Pure state (fleet table, policy, metrics, admission) is built here; every resource
that needs the running loop (the upstream pool and ClientSession, discovery, replica sync) is
one async generator in `cleanup_ctx`, set up above `yield` and torn down below.
Serving it (signals, drain) is `serve()`, used by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

from router.fleet.discovery import Discovery
from router.fleet.table import Fleet
from router.holdings.kv_feed import FeedMember, KvEventFeed
from router.holdings.merge import host_hit_weight
from router.holdings.room import Holdings
from router.holdings.sync import DecisionSync, ReplicaSync
from router.http import dashboard, handlers
from router.http.auth import hot_auth_check, make_auth_check
from router.http.edge import HOT_PATHS, edge_middleware, install_hot_paths, make_edge
from router.http.fast_answer import HeadHook
from router.http.fast_server import FastServer
from router.http.openapi import build_openapi
from router.http.ratelimit import make_rate_limit_check
from router.http.state import (
    CLOCK,
    CONFIG,
    DISCOVERY,
    EDGE,
    FLEET,
    INFERENCE,
    KV_FEED,
    METRICS,
    OPENAPI,
    QUEUE,
    REJECTIONS,
    ROUTING,
    SESSION,
    SYNC,
    TICKET,
    TOKENIZE,
    TOKENS,
    Inference,
)
from router.http.tokenize import Tokenizing, context_tokens
from router.metrics import Metrics
from router.policy import build_policy
from router.policy.base import Policy
from router.queue.fleet_queue import FleetQueue
from router.routing import Routing
from router.upstream.clients import make_transport
from router.upstream.proxy import PROXY, Proxy
from router.upstream.resolver import GuardedResolver
from shared.config import RouterConfig
from shared.serving.access_log import REQUEST_ID, REQUEST_ID_HEADER, OnDone
from shared.serving.aio import stop_task
from shared.serving.errors import ERROR_CODE
from shared.serving.gc_policy import freeze_startup, tune_for_serving
from shared.serving.http_server import KEEPALIVE_S, BindError, bind
from shared.serving.logging import setup_logging
from shared.tokens.fingerprint import tokenizer_fingerprint
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire.peers import Rejections, parse_networks
from shared.wire.registry import Registry

log = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger("router.access")
RATELIMIT_REDIS = web.AppKey("ratelimit_redis", Redis)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # No connection cap here: admission already bounds concurrency, and a pool limit
    # would queue requests invisibly. Keep-alive connections to workers are reused.
    # The resolver refuses link-local, metadata and not-allowed addresses (router/upstream/resolver.py).
    resolver = GuardedResolver(parse_networks(config.worker_url_allow_cidrs))
    connector = aiohttp.TCPConnector(
        limit=0, ttl_dns_cache=60, keepalive_timeout=30, resolver=resolver
    )
    # No cookie jar: a worker's Set-Cookie was kept and sent back to it with every later
    # request, whichever client's (tests/router/upstream/test_passthrough.py); it also spares a
    # jar lookup per request.
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar()
    )
    app[SESSION] = session  # model probes; inference goes through the pool below
    # The inference path's client (router/upstream/transport.py): the project's own by default
    # (~13% of the router's CPU per request was aiohttp's ClientSession,
    # loadtests/results/router_overhead.md), or aiohttp's behind the same interface.
    pool = make_transport(
        config.upstream_client, resolver, config.connect_timeout, config.request_timeout,
        config.max_response_bytes, config.max_buffered_answer_bytes,
    )  # fmt: skip
    app[METRICS].watch_pool(pool)
    app[PROXY] = Proxy(config, app[FLEET], app[ROUTING], pool, app[METRICS], app[CLOCK], app[SYNC])
    app[METRICS].watch_pin_releases(app[PROXY].pin_releases)
    yield
    await pool.close()
    await session.close()


async def _discovery_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    if not config.redis_url:
        yield
        return
    discovery = Discovery.from_url(
        config.redis_url, config.redis_prefix, app[FLEET], config.discovery_interval,
        config.reconnect_grace, app[CLOCK], app[REJECTIONS],
        parse_networks(config.worker_url_allow_cidrs),
    )  # fmt: skip
    app[DISCOVERY] = discovery
    app[METRICS].watch_registry(discovery)
    task = asyncio.create_task(discovery.run(), name="discovery")
    yield
    discovery.stopping = True
    await stop_task(task)


async def _sync_ctx(app: web.Application) -> AsyncIterator[None]:
    sync = app[SYNC]
    if sync is None:
        yield
        return
    await sync.start()
    yield
    await sync.stop()


async def _kv_feed_ctx(app: web.Application) -> AsyncIterator[None]:
    """Every worker's KV-event stream into the index (router/holdings/kv_feed.py), while up."""
    feed = app.get(KV_FEED)
    config = app[CONFIG]
    if feed is None:
        yield
        return
    idle = _kv_idle(config)
    fleet = app[FLEET]

    def members() -> list[FeedMember]:
        return [
            FeedMember(
                w.worker_id,
                w.report.model,
                w.report.epoch,
                w.report.kv_capacity_tokens,
                w.report.kv_block_size,
                w.report.host_kv_capacity_tokens,
            )
            for w in fleet.workers.values()
            if w.source == "redis" and w.report.epoch
        ]

    task = asyncio.create_task(feed.run(members, idle), name="kv-events")
    yield
    feed.stop()
    await stop_task(task)
    await feed.registry.redis.aclose()


def _kv_idle(config: RouterConfig) -> float:
    """How long one read of the KV-event streams waits for news."""
    return min(0.5, config.discovery_interval)


def _kv_feed(config: RouterConfig) -> KvEventFeed | None:
    """The workers' KV-event streams (config `kv_events`, which needs `redis_url` and a
    `tokenizer`), on their own client: XREAD blocks for up to `_kv_idle`, longer than a
    short socket timeout (and a read may wait on a busy Redis). Created here, connected on
    first use inside the loop."""
    if not (config.kv_events and config.tokenizer and config.redis_url):
        return None
    idle = _kv_idle(config)
    redis = Redis.from_url(config.redis_url, socket_timeout=idle + 5, socket_connect_timeout=5)
    return KvEventFeed(
        Registry(redis, config.redis_prefix), config.kv_events_max_blocks,
        max_lag=config.kv_events_max_lag, block_size=config.kv_events_block_size,
        stream_len=config.kv_events_stream_len,
    )  # fmt: skip


async def _tokenize_ctx(app: web.Application) -> AsyncIterator[None]:
    """The tokenizer thread (router/http/tokenize.py), stopped with the app."""
    yield
    tokenize = app.get(TOKENIZE)
    if tokenize is not None:
        tokenize.close()


async def _queue_ctx(app: web.Application) -> AsyncIterator[None]:
    """The fleet queue re-reads seats while requests wait (router/queue/fleet_queue.py)."""
    task = asyncio.create_task(app[QUEUE].run(), name="fleet-queue")
    yield
    await stop_task(task)


def _on_head(queue: FleetQueue) -> HeadHook:
    """The app's `on_response_prepare` hook, `queue` bound (no app lookup per answer): a
    plain call the own protocol makes itself (router/http/fast_answer.py `HeadHook`)."""

    def on_head(request: web.Request, response: web.StreamResponse) -> None:
        """An answer's head is leaving: it carries the request's id
        (shared/serving/access_log.py), and the fleet queue takes its TTFT for the
        request's class. One hook, not two: each is one more coroutine per answer."""
        rid = request.get(REQUEST_ID)
        if rid is not None:
            response.headers[REQUEST_ID_HEADER] = rid
        ticket = request.get(TICKET)
        if ticket is not None:
            queue.answered(ticket, response.status)

    return HeadHook(on_head)


async def _ratelimit_redis_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    redis = app.get(RATELIMIT_REDIS)
    if redis is not None:
        await redis.aclose()


def _counter(metrics: Metrics) -> OnDone:
    """Per request: the worker that answered, or why the router refused it."""

    def on_done(
        request: web.Request, status: int, seconds: float, response: web.StreamResponse | None
    ) -> None:
        if response is None:
            return
        worker = response.headers.get("x-radix-worker")
        if worker is not None:
            metrics.answered(worker, status)
        elif status in (429, 503):
            metrics.refused(request.get(ERROR_CODE) or str(status))

    return on_done


def routes() -> list[web.RouteDef]:
    """Every route, in one table (the dashboard's two among them)."""
    return [
        web.post("/v1/chat/completions", handlers.chat_completions),
        web.post("/v1/completions", handlers.completions),
        web.post("/generate", handlers.generate),
        web.get("/v1/models", handlers.models),
        web.get("/health", handlers.health),
        web.get("/liveness", handlers.liveness),
        web.get("/readiness", handlers.readiness),
        web.get("/metrics", handlers.metrics),
        web.get("/workers", handlers.list_workers),
        web.post("/workers", handlers.add_worker),
        web.delete("/workers/{worker_id}", handlers.delete_worker),
        web.get("/openapi.json", handlers.openapi),
        web.get(dashboard.PAGE_PATH, dashboard.page),
        web.get(dashboard.DATA_PATH, dashboard.data),
    ]


def create_app(
    config: RouterConfig,
    *,
    policy: Policy | None = None,
    clock: Callable[[], float] = time.monotonic,
    sync: ReplicaSync | None = None,
) -> web.Application:
    """The router. `sync` shares decisions and load with other replicas; by default a
    `DecisionSync` over `redis_url` when `config.sync` is on, else none."""
    policy = policy if policy is not None else build_policy(config)
    rejections = Rejections()  # what the Redis boundary refused (shared/wire/peers.py)
    # The prompt ids: the holdings room keys on them, and replica sync shares them.
    tokens = PromptTokens.load(config.tokenizer) if config.tokenizer else None
    feed = _kv_feed(config)
    # What each worker holds (router/holdings/room.py); it reads the fleet's heartbeats
    # for host weights, through the fleet built below.
    holdings = Holdings(config, feed, _host_weight(config, lambda: fleet))
    if sync is None and config.sync and config.redis_url:
        # The sync shares the fleet's in-flight counts and the fleet reads the sync's:
        # the fleet is given the sync's figures at construction, the sync asks the
        # fleet (built next) when it flushes; decisions it reads go to the routing
        # (built next too), which publishes this router's through it.
        sync = DecisionSync.connect(
            config, lambda w, key, now: routing.observe(w, key, now),
            lambda: fleet.in_flight_by_worker(), clock, rejections,
            tokenizer_fingerprint(tokens.tokenizer) if tokens is not None else None,
        )  # fmt: skip
    fleet = Fleet(config, holdings, sync.remote_inflight if sync is not None else None)
    routing = Routing(holdings, policy, sync.publish if sync is not None else None)
    for url in config.worker_urls:
        fleet.add_url(url, "static")
    metrics = Metrics(fleet, clock, lambda: queue.active + queue.waiting, rejections)
    queue = FleetQueue(
        config, fleet, holdings.affinity, sync.remote_inflight if sync is not None else None,
        clock, metrics.registry,
    )  # fmt: skip
    # Created here (redis-py connects on first use, inside the loop), closed in cleanup.
    ratelimit_redis = None
    if config.rate_limit_per_key is not None and config.redis_url:
        timeout = config.rate_limit_redis_timeout
        ratelimit_redis = Redis.from_url(
            config.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
    auth = make_auth_check(config)
    edge = make_edge(
        ACCESS_LOG, (("worker", "x-radix-worker"), ("route", "x-radix-route-reason")),
        _counter(metrics), auth, make_rate_limit_check(config, clock, ratelimit_redis),
        access_log=config.access_log, hot_auth=hot_auth_check(config, auth, HOT_PATHS),
    )  # fmt: skip
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[edge_middleware(edge)]
    )
    app[EDGE] = edge
    app[CONFIG] = config
    app[CLOCK] = clock
    app[ROUTING] = routing
    app[FLEET] = fleet
    app[SYNC] = sync
    app[METRICS] = metrics
    app[REJECTIONS] = rejections
    app[QUEUE] = queue
    app[OPENAPI] = build_openapi()
    if ratelimit_redis is not None:
        app[RATELIMIT_REDIS] = ratelimit_redis
    if tokens is not None:
        app[TOKENS] = tokens
        context = context_tokens(config.max_prompt_tokens, config.tokenizer or "")
        app[TOKENIZE] = Tokenizing(tokens, context)
    if feed is not None:
        app[KV_FEED] = feed
        metrics.watch_kv_feed(feed)
    app[INFERENCE] = Inference(config, clock, fleet, metrics, queue, app.get(TOKENIZE))
    app.on_response_prepare.append(_on_head(queue))
    app.cleanup_ctx.extend(
        [
            _session_ctx,
            _discovery_ctx,
            _sync_ctx,
            _kv_feed_ctx,
            _ratelimit_redis_ctx,
            _queue_ctx,
            _tokenize_ctx,
        ]
    )
    app.router.add_routes(routes())
    return app


def _host_weight(config: RouterConfig, fleet: Callable[[], Fleet]) -> Callable[[str], float]:
    """A host-held token's worth per worker (router/holdings/merge.py): the configured
    one, or each worker's own from its latest heartbeat in `fleet()`'s table."""
    fixed = config.kv_events_host_weight
    if fixed is not None:
        return lambda _wid: fixed
    default_us = config.cost_prefill_us_per_token

    def of(wid: str) -> float:
        worker = fleet().workers.get(wid)
        return host_hit_weight(worker.report if worker is not None else None, default_us)

    return of


async def serving_runner(app: web.Application) -> web.AppRunner:
    """The app's runner, set up as `serve()` serves it (then `bind` it): what the server
    conformance suite (tests/router/http/test_server_conformance.py) holds to its table."""
    # handler_cancellation: a client that disconnects cancels its handler, which
    # cancels the upstream request and releases its load guard.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=KEEPALIVE_S)  # fmt: skip
    await runner.setup()
    # The inference routes straight from aiohttp's server to the edge (router/http/edge.py).
    install_hot_paths(runner, app[EDGE])
    return runner


def serving_protocol(runner: web.AppRunner, config: RouterConfig) -> FastServer | None:
    """The listening protocol `bind` gives each connection: aiohttp's (None), or the
    router's own for the simplest inference requests (`fast_hot_paths`)."""
    if not config.fast_hot_paths:
        return None
    edge = runner.app[EDGE]
    return FastServer(runner, edge, config.max_body_bytes, config.header_read_timeout)


async def stop_serving(runner: web.AppRunner, fast: FastServer | None) -> None:
    """Stop listening and close every connection: the router's own protocol's first
    (aiohttp's server does not know them, so `runner.cleanup()` alone left the idle
    ones open), then aiohttp's and the app's cleanup."""
    if fast is not None:
        fast.close()
    await runner.cleanup()


async def serve(config: RouterConfig, ready: Callable[[int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then: readiness 503 at once while still serving for
    `shutdown_delay` (load balancers stop sending), then refuse new work (503) and let
    in-flight requests (streams included) finish within `drain_timeout`, and return."""
    app = create_app(config)
    runner = await serving_runner(app)
    fast = serving_protocol(runner, config)
    # The app and its cleanup_ctx are built: out of every collection from now on. Before
    # the bind, so no request waits on this one full pass; the fleet's first read is
    # frozen too, later (`_settle_gc`), at the cost of a pass over what is young only.
    freeze_startup()
    tune_for_serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    # Everything from here on inside the try: a bind that fails (port taken) must clean
    # the runner up, else its tasks (discovery, replica sync) kept the process alive,
    # deaf to SIGTERM (issue 21). BindError goes up to the CLI: exit 1.
    try:
        # Several router processes share the port (router/up/processes.py): the kernel
        # spreads connections over them, to a child the moment it binds. A child
        # (re)started beside running siblings therefore binds once it has read the
        # registry: bound before, it answered its share of requests 503 "no healthy
        # worker" while its siblings routed (tests/e2e/test_router_processes.py failed 1
        # run in 3 that way).
        discovery = app.get(DISCOVERY)
        if config.processes > 1 and discovery is not None:
            with contextlib.suppress(TimeoutError):
                # A poll gives up within 2 intervals (router/fleet/discovery.py); Redis down.
                first = discovery.first_poll.wait()
                await asyncio.wait_for(first, 3 * config.discovery_interval + 1)
        await bind(runner, config.host, config.port, reuse_port=config.processes > 1,
                   header_read_timeout=config.header_read_timeout,
                   protocol=fast)  # fmt: skip
        port = runner.addresses[0][1] if runner.addresses else config.port
        log.info("router listening on http://%s:%s (policy %s)", config.host, port, config.policy)
        settle = asyncio.create_task(_settle_gc(discovery, config), name="gc-settle")
        if ready is not None:
            ready(port)
        await stop.wait()
        await stop_task(settle)
        app[QUEUE].stopping = True
        if config.shutdown_delay > 0:
            log.info("stopping: not ready, still serving for %.1fs", config.shutdown_delay)
            await asyncio.sleep(config.shutdown_delay)
        queue = app[QUEUE]
        log.info("draining: %d in flight, up to %.0fs", queue.active, config.drain_timeout)
        if not await queue.drain(config.drain_timeout):
            log.warning("drain timeout: %d requests still in flight", queue.active)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await stop_serving(runner, fast)


async def _settle_gc(discovery: Discovery | None, config: RouterConfig) -> None:
    """Start-up's objects out of the garbage collector's passes (shared/serving/gc_policy.py),
    once the fleet is first read: the registry's workers and their tables are start-up too."""
    if discovery is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(discovery.first_poll.wait(), 3 * config.discovery_interval + 1)
    frozen = freeze_startup()
    log.debug("gc: %d start-up objects frozen, thresholds %s", frozen, gc.get_threshold())


def run_router(config: RouterConfig) -> int:
    """One router process, in the foreground until SIGTERM/SIGINT; 1 when it cannot
    listen (the port taken: one line says so, within seconds, in every mode)."""
    setup_logging(config.log_level)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(config))
    except BindError as e:
        log.error("%s", e)
        return 1
    return 0
