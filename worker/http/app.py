"""The worker's aiohttp application: typed state, middlewares, resources, routes.

`create_app(config, engine)` is the only way an app is built (CLI, tests, benchmark).
Resources live in `cleanup_ctx`, each set up above its `yield` and torn down below:
the engine (started in the background so `/health` answers 503 until it is up) and,
with a Redis URL, the heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import fields

from aiohttp import web
from pydantic import ValidationError

from shared.config import WorkerConfig
from shared.serving.access_log import make_access_middleware, stamp_request_id
from shared.serving.aio import stop_task
from shared.serving.auth import KeySet, unauthorized
from shared.serving.errors import APIError, Handler, error_middleware
from shared.serving.http import INFERENCE_PATHS
from shared.wire.registry import Registry, WorkerRecord
from worker.engine.types import Engine, EngineStats
from worker.heartbeat import Heartbeat, connect
from worker.http import admin_api, openai_api
from worker.http.metrics import WorkerMetrics
from worker.http.state import CONFIG, ENGINE, HEARTBEAT, METRICS, STATE, WorkerState
from worker.kv_publisher import KvEventPublisher

log = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger("worker.access")


# Readable without an API key (probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def default_worker_id(config: WorkerConfig) -> str:
    return config.worker_id or f"{socket.gethostname()}-{config.port}"


def make_auth_middleware(config: WorkerConfig) -> web.middleware:
    """Every path but the public ones needs a key when `api_keys` is set (inference and
    `/flush_cache` alike); a router sends its `worker_api_key`, which must be one of them."""
    keys = KeySet(config.api_keys)

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path not in PUBLIC_PATHS and not keys.allows(request.headers):
            raise unauthorized()
        return await handler(request)

    return auth_middleware


@web.middleware
async def lifecycle_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse work until ready and while draining; count what is in flight for the drain."""
    if request.path not in INFERENCE_PATHS:
        return await handler(request)
    state = request.app[STATE]
    if state.draining:
        raise APIError(
            503, "worker is shutting down", code="draining", headers={"Retry-After": "1"}
        )
    if not state.ready.is_set():
        raise APIError(503, "engine is starting", code="not_ready", headers={"Retry-After": "1"})
    state.inflight += 1
    state.idle.clear()
    start = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except APIError as exc:
        status = exc.status
        raise
    except ValidationError:
        status = 400  # error_middleware answers it
        raise
    finally:
        state.inflight -= 1
        if state.inflight == 0:
            state.idle.set()
        request.app[METRICS].request_done(request.path, status, time.perf_counter() - start)


async def _stamp_worker_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-worker-id"] = request.app[STATE].worker_id


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine, state = app[ENGINE], app[STATE]

    async def boot() -> None:
        try:
            await engine.start()
        except Exception as exc:  # reported by serve(), which exits non-zero
            log.exception("engine failed to start")
            state.failure = exc
        else:
            state.ready.set()
        finally:
            state.booted.set()

    task = asyncio.create_task(boot(), name="engine-start")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await engine.stop()


# The engine's stats carry the heartbeat's own names: a record field the engine reports
# is copied by name, never renamed on the way (tests/worker/test_heartbeat.py holds that).
_REPORTED = frozenset(f.name for f in fields(WorkerRecord)) & frozenset(
    f.name for f in fields(EngineStats)
)


def make_record(config: WorkerConfig, engine: Engine, state: WorkerState) -> WorkerRecord:
    stats = engine.stats()
    return WorkerRecord(
        worker_id=state.worker_id,
        url=state.url or config.advertise_url or f"http://{config.host}:{config.port}",
        model=state.served_model,
        engine=config.engine,
        epoch=state.epoch,
        draining=state.draining,
        **{name: getattr(stats, name) for name in _REPORTED},
    )


async def _heartbeat_ctx(app: web.Application) -> AsyncIterator[None]:
    config, engine, state = app[CONFIG], app[ENGINE], app[STATE]
    if not config.redis_url:
        yield
        return
    redis = connect(config.redis_url, config.heartbeat_interval, config.redis_password_file)
    heartbeat = Heartbeat(
        Registry(redis, config.redis_prefix),
        lambda: make_record(config, engine, state),
        config.heartbeat_interval,
        config.heartbeat_ttl_intervals,
    )
    app[HEARTBEAT] = heartbeat
    heartbeat.start(state.ready)
    try:
        yield
    finally:
        if heartbeat.joined:
            await heartbeat.leave()
        await heartbeat.stop()
        await redis.aclose()


async def _kv_publisher_ctx(app: web.Application) -> AsyncIterator[None]:
    """With `kv_events` and Redis: the cache's KV events onto this worker's stream."""
    config, engine, state = app[CONFIG], app[ENGINE], app[STATE]
    if not (config.kv_events and config.redis_url):
        yield
        return
    redis = connect(config.redis_url, config.heartbeat_interval, config.redis_password_file)
    publisher = KvEventPublisher(
        Registry(redis, config.redis_prefix),
        state.worker_id,
        state.epoch,
        lambda: getattr(engine, "kv_events", None),  # the radix backend has it once loaded
        config.kv_events_stream_len,
        config.kv_events_interval,
    )
    task = asyncio.create_task(publisher.run(state.ready), name="kv-events")
    try:
        yield
    finally:
        await stop_task(task)
        await redis.aclose()


ROUTES = [
    web.post("/v1/completions", openai_api.completions),
    web.post("/v1/chat/completions", openai_api.chat_completions),
    web.post("/generate", openai_api.generate),
    web.get("/v1/models", admin_api.models),
    web.get("/health", admin_api.health),
    web.get("/metrics", admin_api.metrics),
    web.post("/flush_cache", admin_api.flush_cache),
    web.post("/release_pin", admin_api.release_pin),
    web.get("/get_server_info", admin_api.server_info),
    web.get("/openapi.json", admin_api.openapi),
]


def create_app(config: WorkerConfig, engine: Engine) -> web.Application:
    app = web.Application(
        middlewares=[
            make_access_middleware(ACCESS_LOG, enabled=config.access_log),
            error_middleware,
            make_auth_middleware(config),
            lifecycle_middleware,
        ],
        client_max_size=config.max_body_bytes,
    )
    state = WorkerState(
        worker_id=default_worker_id(config),
        served_model=config.served_model_name or engine.model_name,
        url=config.advertise_url,
    )
    state.idle.set()
    app[CONFIG] = config
    app[ENGINE] = engine
    app[STATE] = state
    app[METRICS] = WorkerMetrics(engine.stats, lambda: state.draining)
    app.on_response_prepare.append(_stamp_worker_id)
    app.on_response_prepare.append(stamp_request_id)
    app.cleanup_ctx.extend([_engine_ctx, _heartbeat_ctx, _kv_publisher_ctx])
    app.add_routes(ROUTES)
    return app
