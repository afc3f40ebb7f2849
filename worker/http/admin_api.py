"""The worker's non-inference endpoints: models, health, metrics, cache flush, info,
and the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

from shared.serving.body import read_json
from shared.serving.errors import APIError
from shared.serving.http import PROMETHEUS_TEXT
from shared.wire.protocol import MAX_PROMPT_CACHE_KEY_BYTES
from worker.http.intake import pin_key
from worker.http.openapi import openapi_document
from worker.http.state import CONFIG, ENGINE, METRICS, STATE

RELEASE_PIN_MAX_BYTES = 4096  # {"prompt_cache_key": ...} of at most 1,024 bytes, escaped


async def models(request: web.Request) -> web.Response:
    state, engine = request.app[STATE], request.app[ENGINE]
    card = {
        "id": state.served_model,
        "object": "model",
        "created": int(state.epoch),
        "owned_by": "radix-router",
        "root": request.app[CONFIG].model or state.served_model,
        "max_model_len": engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """200 when the engine is up and the worker takes requests; 503 before and while draining."""
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.ready.is_set():
        return web.json_response({"status": "starting"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})


async def flush_cache(request: web.Request) -> web.Response:
    if not request.app[STATE].ready.is_set():
        raise APIError(503, "engine is starting", code="not_ready")
    if not await request.app[ENGINE].flush_cache():
        raise APIError(409, "cannot flush the cache while requests are running", code="busy")
    return web.json_response({"flushed": True})


async def release_pin(request: web.Request) -> web.Response:
    """``{"prompt_cache_key": K}``: release the session's pin here (the router moved the
    session to another worker: worker/engine/pins.py). 200 ``{"released": bool}``."""
    if not request.app[STATE].ready.is_set():
        raise APIError(503, "engine is starting", code="not_ready")
    config = request.app[CONFIG]
    # A key is at most 1,024 bytes: the body is bounded far below the inference limit.
    _, body = await read_json(request, RELEASE_PIN_MAX_BYTES, config.body_read_timeout)
    key = body.get("prompt_cache_key")
    if not isinstance(key, str) or not key:
        raise APIError(400, "prompt_cache_key: a non-empty string is required",
                       param="prompt_cache_key")  # fmt: skip
    if len(key.encode("utf-8", "surrogatepass")) > MAX_PROMPT_CACHE_KEY_BYTES:
        raise APIError(400, f"prompt_cache_key: longer than {MAX_PROMPT_CACHE_KEY_BYTES} bytes",
                       param="prompt_cache_key")  # fmt: skip
    held_as = pin_key(request, key)  # the router's key for the session, where it sends one
    return web.json_response({"released": await request.app[ENGINE].release_pin(held_as)})


async def server_info(request: web.Request) -> web.Response:
    config, state, engine = request.app[CONFIG], request.app[STATE], request.app[ENGINE]
    stats = engine.stats()
    return web.json_response(
        {
            "worker_id": state.worker_id,
            "model": state.served_model,
            "engine": config.engine,
            "epoch": state.epoch,
            "url": state.url,
            "ready": state.ready.is_set(),
            "draining": state.draining,
            "max_model_len": engine.max_model_len,
            "stats": stats.__dict__,
            # The config minus secrets: what a router or operator needs to know.
            "config": config.model_dump(mode="json", exclude={"api_keys", "redis_url"}),
        }
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[STATE].served_model))
