"""HTTP handlers: validate at the edge, then hand inference to the proxy.

A bad request is answered here (400/404/413 in the OpenAI shape) and never reaches,
nor is retried across, the fleet. The handlers know nothing of which policy runs.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from router.fleet.workers import Worker
from router.holdings.kv_feed import KvEventFeed
from router.holdings.namespace import DEFAULT as DEFAULT_NAMESPACE
from router.holdings.namespace import fields_namespace
from router.holdings.sessions import session_digest, tenant_of
from router.http.auth import request_bearer_token
from router.http.state import (
    CLOCK,
    CONFIG,
    DISCOVERY,
    FLEET,
    INFERENCE,
    KV_FEED,
    METRICS,
    OPENAPI,
    QUEUE,
    ROUTING,
    SESSION,
    TICKET,
)
from router.http.tokenize import LATER, ChatPrompt, request_prompt
from router.queue.tenants import DEFAULT as DEFAULT_TENANT
from router.upstream.answers import worker_authorization
from router.upstream.proxy import PROXY, Routed, echo_of
from shared.serving.body import LARGE_BODY_BYTES, WHOLE_BODY, parse_json_object, read_json
from shared.serving.errors import APIError
from shared.serving.http import PROMETHEUS_TEXT
from shared.wire.peers import check_worker_id, check_worker_url, parse_networks, served_model
from shared.wire.plain_body import chat_text, plain_chat, plain_extra
from shared.wire.protocol import chat_request, routing_text
from shared.wire.service_class import request_class

MODELS_PROBE_TIMEOUT_S = 2.0
MODELS_MAX_BYTES = 1 << 20


async def read_request_json(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The decoded body (what is forwarded) and its checked JSON object (shared/serving/body.py)."""
    config = request.app[CONFIG]
    return await read_json(request, config.max_body_bytes, config.body_read_timeout)


def _status_of(error: BaseException) -> int:
    """The status a failed handler answers with (the error middleware makes the response)."""
    if isinstance(error, APIError):
        return error.status
    if isinstance(error, ValidationError):
        return 400
    if isinstance(error, web.HTTPException):
        return error.status
    # The client went away before an answer (nginx's convention), or a bug (500).
    return 499 if isinstance(error, asyncio.CancelledError) else 500


def _session_namespace(tenant: str, request: web.Request) -> str:
    """Whose prompt_cache_key it is: the tenant its API key belongs to (config
    `tenants`), else the API key's own identity, hashed (router/holdings/sessions.py)."""
    if tenant != DEFAULT_TENANT:
        return "tenant:" + tenant
    return tenant_of(request_bearer_token(request))


def _inference_handler(endpoint: str, path: str) -> Any:
    # Chat and completion bodies of plain values are checked by hand and read in place
    # (shared/wire/plain_body.py `plain_extra`), tokenized or not: no request model built.
    # `/generate`, and any body the hand check leaves to the model, take the model.
    plain = endpoint != "generate"

    # Timing lives in the handler rather than in a middleware: one coroutine layer less on
    # every request, and only inference requests are timed anyway.
    async def handler(request: web.Request) -> web.StreamResponse:
        app = request.app
        bound = app[INFERENCE]
        clock, metrics, config = bound.clock, bound.metrics, bound.config
        start = clock()
        status = 499
        try:
            # The body is read and checked before the request may take a slot: a client
            # trickling its body holds no capacity (shared/serving/body.py). One that came
            # whole with its head (the own protocol's, router/http/fast_server.py) is
            # parsed as it is: no read, no coroutine.
            raw = request.get(WHOLE_BODY)
            if raw is not None and len(raw) <= LARGE_BODY_BYTES:
                data = parse_json_object(raw)
            else:
                raw, data = await read_json(
                    request, config.max_body_bytes, config.body_read_timeout
                )
            # The router's tokenizer, where one is configured: bounded, long prompts off
            # the event loop, over-long ones routed on their text's head alone.
            tokenize = bound.tokenize
            render = ids = prompt = text = None
            if not plain:
                extra = None
            elif tokenize is None or endpoint != "chat":
                extra = plain_extra(endpoint, data)
            else:  # a chat to tokenize: its check reads its turns too
                extra, turns = plain_chat(data) or (None, None)
            if extra is not None:  # its model takes it as sent: its fields read in place
                parsed = None
                if endpoint == "completions":
                    text = prompt = data["prompt"]
                elif tokenize is None:
                    text = chat_text(data["messages"])
                else:
                    generation = data.get("add_generation_prompt") is not False  # (a bool)
                    prompt = ChatPrompt(turns, generation)
                model = data.get("model")
                session_key = request.headers.get(config.session_header) or data.get("user")
                stream = data.get("stream") is True
                salt = data.get("cache_salt")
                cache_key = data.get("prompt_cache_key")
            else:
                if endpoint == "chat" and tokenize is not None:
                    parsed = chat_request(data)  # pydantic errors → 400
                else:
                    text, parsed = routing_text(endpoint, data)  # pydantic errors → 400
                if tokenize is not None:
                    prompt = request_prompt(parsed, data)
                model = getattr(parsed, "model", None)
                session_key = request.headers.get(config.session_header) or getattr(
                    parsed, "user", None
                )
                stream = getattr(parsed, "stream", None) is True or data.get("stream") is True
                salt = getattr(parsed, "cache_salt", None)
                # `model_extra`'s own slot: the property is one call more a request.
                extra = getattr(parsed, "__pydantic_extra__", None)
                cache_key = getattr(parsed, "prompt_cache_key", None)
            if tokenize is not None:
                if text is not None:
                    chars = len(text)
                elif len(raw) <= tokenize.quick_chars:
                    # A chat routed on its ids: its text is rendered only if something
                    # reads it (RouteRequest), and its body's length bounds the text's
                    # (Tokenizing).
                    text, chars = "", len(raw)
                    render = partial(chat_text, data["messages"])
                else:
                    text = chat_text(data["messages"])
                    chars = len(text)
                ids = tokenize.now(prompt, chars)
                if ids is LATER:
                    ids = await tokenize.later(prompt)
                if chars > tokenize.max_chars:
                    text = text[: tokenize.max_chars]
            adapter = bound.fleet.serves_adapter(model)
            namespace = (
                DEFAULT_NAMESPACE
                if not extra and salt is None and not adapter
                else fields_namespace(model, salt, extra, tokenize is not None, adapter)
            )
            if "priority" in data or "service_tier" in data:
                klass, priority = request_class(data)  # a bad service_tier or priority → 400
                # An engine that schedules by `priority` gets the class's where the body
                # names a tier but no priority (router/upstream/proxy.py).
                add = priority if "priority" not in data else None
            else:  # `request_class`'s answer for a body naming neither: no call
                klass, add = "standard", None
            routed = Routed(
                endpoint, path, raw, text, session_key, model, ids, stream, add, namespace,
                render,
            )  # fmt: skip
            queue = bound.queue
            tenants = queue.tenants
            tenant = tenants.of_headers(request.headers) if tenants.keyed else tenants.default
            if cache_key is not None:  # namespaced by the caller's tenant (sessions.py)
                routed.cache_key = session_digest(
                    _session_namespace(tenant.name, request), cache_key
                )
                if parsed is None:  # (the model holds a float: 300 is 300.0)
                    ttl = data.get("cache_pin_ttl")
                    routed.pin_ttl = float(ttl) if ttl else 0.0
                else:
                    routed.pin_ttl = getattr(parsed, "cache_pin_ttl", None) or 0.0
                routed.prompt_cache_key = cache_key
            # Admitted (or refused) here; the seat is freed whatever the way out. The
            # common case, a free seat, costs no coroutine (`Seat` as `async with` did),
            # and the ticket is the proxy's seat itself (no `Seat` object either).
            ticket = request[TICKET] = queue.arrive(tenant, klass, routed.route)
            if ticket.seated is None:
                await queue.wait_turn(ticket)
            try:
                response = await app[PROXY].forward(request, routed, ticket)
            except BaseException:
                queue.done(ticket)
                raise
            # A whole answer is ready to leave (a stream's head left already and was told
            # by the app's on_response_prepare hook: the first of the two counts).
            queue.served(ticket, response.status)
            status = response.status
            return response
        except BaseException as e:
            status = _status_of(e)
            raise
        finally:
            metrics.request_done(endpoint, status, clock() - start)

    handler.__name__ = f"{endpoint}_handler"
    return handler


chat_completions = _inference_handler("chat", "/v1/chat/completions")
completions = _inference_handler("completions", "/v1/completions")
generate = _inference_handler("generate", "/generate")


async def _probe_model(request: web.Request, worker: Worker) -> None:
    """Workers not from the registry (static, admin) report no model: ask them once."""
    try:
        auth = worker_authorization(request.app[CONFIG])
        async with request.app[SESSION].get(
            worker.url + "/v1/models", timeout=MODELS_PROBE_TIMEOUT_S, allow_redirects=False,
            headers={"Authorization": auth} if auth else None,
        ) as r:  # fmt: skip
            # A worker's model list is small; more is not read (workers are peers, not trusted).
            data = json.loads(await r.content.read(MODELS_MAX_BYTES)) if r.status == 200 else {}
        request.app[FLEET].set_model(worker, served_model(data))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return  # the worker stays without a model name; routing does not need one


async def models(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    unknown = [w for w in fleet.workers.values() if not w.report.model]
    if unknown:
        await asyncio.gather(*(_probe_model(request, w) for w in unknown))
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "radix-router", "parent": parent}
        for m, parent in fleet.models().items()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    app = request.app
    if app[QUEUE].draining:
        return web.json_response({"status": "draining"}, status=503)
    routable = len(app[FLEET].view(app[CLOCK]()))  # the kept view: no pass over the fleet
    if routable == 0:
        return web.json_response({"status": "no_workers", "workers": 0}, status=503)
    return web.json_response({"status": "ok", "workers": routable})


async def liveness(request: web.Request) -> web.Response:
    """The process and its event loop are up: nothing else (no workers needed), so a
    router is never restarted while a fleet's models are still loading."""
    return web.json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    """Ready to take traffic: not shutting down and at least one worker routable. An
    unreachable registry does not make it unready (the last known fleet still serves),
    but the body says so: `"registry": "unreachable since <time>"`."""
    app = request.app
    queue = app[QUEUE]
    discovery = app.get(DISCOVERY)
    registry = {} if discovery is None else {"registry": discovery.state}
    if queue.stopping or queue.draining:
        body = {"status": "not_ready", "reason": "shutting_down", **registry}
        return web.json_response(body, status=503)
    routable = len(app[FLEET].view(app[CLOCK]()))
    if routable == 0:
        reason = "no routable worker (none registered, all draining, or all breakers open)"
        return web.json_response({"status": "not_ready", "reason": reason, **registry}, status=503)
    return web.json_response({"status": "ready", "workers": routable, **registry})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})


def _rebuild(feed: KvEventFeed | None, wid: str) -> dict[str, int] | None:
    """A rebuilding worker's progress (router/holdings/feed_entries.py): trusted again once it has
    removed `needed` blocks since the loss (0: its pool size is not known)."""
    rebuild = feed.rebuild_of(wid) if feed is not None else None
    return None if rebuild is None else {"removed": rebuild.removed, "needed": rebuild.needed}


async def list_workers(request: web.Request) -> web.Response:
    app = request.app
    now = app[CLOCK]()
    holdings = app[ROUTING].holdings
    trees = holdings.worker_stats()
    queue = app[QUEUE]
    out = []
    for w in list(app[FLEET].workers.values()):
        item = w.describe(now)
        item.update(queue.seats.describe(w.worker_id))
        item["tree"] = trees.get(w.worker_id, {})
        # The share of its predicted hits routing believes: below 1, its answers' cached
        # tokens did not bear its claims out (router/holdings/claims.py).
        item["claims_believed"] = holdings.claims.believed(w.worker_id)
        feed = app.get(KV_FEED)
        item["kv_events"] = feed.status_of(w.worker_id) if feed is not None else None
        item["kv_events_rebuild"] = _rebuild(feed, w.worker_id)
        item["request_id_echo"] = echo_of(app, w.url)
        out.append(item)
    # The fleet queue per tenant and class (router/queue/stats.py).
    return web.json_response({"object": "list", "data": out, "queue": queue.stats.snapshot()})


async def add_worker(request: web.Request) -> web.Response:
    _, data = await read_request_json(request)
    url, wid = data.get("url"), data.get("worker_id")
    if not isinstance(url, str):
        raise APIError(400, "url: a string http(s)://host:port is required", param="url")
    if wid is not None:
        try:
            check_worker_id(wid)
        except ValueError as e:
            raise APIError(
                400, f"worker_id: {e}", param="worker_id", code="invalid_value"
            ) from None
    try:
        check_worker_url(url, parse_networks(request.app[CONFIG].worker_url_allow_cidrs))
    except ValueError as e:
        raise APIError(400, f"url: {e}", param="url", code="invalid_value") from None
    worker = request.app[FLEET].add_url(url, "admin", wid)
    return web.json_response(worker.describe(request.app[CLOCK]()), status=201)


async def delete_worker(request: web.Request) -> web.Response:
    wid = request.match_info["worker_id"]
    if not request.app[FLEET].remove(wid):
        raise APIError(404, f"no worker {wid!r}", param="worker_id", code="worker_not_found")
    return web.json_response({"deleted": wid})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
