"""The router's edge: request id, access log and counts, OpenAI-shaped errors, API keys
and the rate limit, in the order four middlewares used to run them.

Per request, outermost first (`shared/serving/access_log.py` `serve_logged`, which the
worker's access middleware runs too):

1. the request id and the start time;
2. the API-key check (`router/http/auth.py`), then the rate limit (`router/http/ratelimit.py`);
3. the handler;
4. anything raised by 2 or 3 becomes its OpenAI-shaped answer (`shared/serving/errors.py`);
5. when the request ends (answered, failed, or the client left: 499), `on_done` counts
   it and the access-log line is written.

Two ways in, one edge:

- the hot paths, `POST /v1/chat/completions` and `POST /v1/completions` (that exact
  path, no query, no `Expect`): `install_hot_paths` hands them from aiohttp's server
  (its protocol, C parser, request and response objects all kept) straight to the
  edge and the route's handler. No route resolution, no middleware chain: each
  middleware is one more coroutine wrapped around the next, and `Application._handle`
  resolves the path and builds the chain on every request;
- everything else (and the hot paths where the hot-path hook is not installed, as in
  aiohttp's test server): the app's router, then `edge_middleware`, which runs the same
  edge. The request's `match_info` is the route's either way, so `request.app` and the
  app's `on_response_prepare` hooks (the request id header, the fleet queue's first
  byte) run as they do for any route.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import UrlMappingMatchInfo

from router.http.auth import AuthCheck
from router.http.ratelimit import RateLimitCheck
from shared.serving.access_log import AccessLog, Guard, OnDone, serve_logged
from shared.serving.errors import Handler, error_response_for

# The inference routes taken without the app's router (see the module docstring).
HOT_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True, slots=True)
class Edge:
    """What every request passes through (built once by `make_edge`)."""

    log: AccessLog
    auth: AuthCheck
    rate_limit: RateLimitCheck | None
    # `guard` for `HOT_PATHS` alone: None where it has nothing to do there (no client
    # key, no rate limit), which spares the hot paths three calls a request.
    hot_guard: Guard | None = None

    def guard(self, request: web.Request) -> Awaitable[None] | None:
        """The API key, then the rate limit: an awaitable only where the limit is shared."""
        self.auth(request)
        rate_limit = self.rate_limit
        return rate_limit(request) if rate_limit is not None else None


def make_edge(
    logger: logging.Logger,
    fields: tuple[tuple[str, str], ...],
    on_done: OnDone,
    auth: AuthCheck,
    rate_limit: RateLimitCheck | None,
    access_log: bool = True,
    *,
    hot_auth: AuthCheck | None,
) -> Edge:
    """`fields`: (log name, response header) pairs added to the access-log line;
    `hot_auth`: `auth` as `HOT_PATHS` need it (router/http/auth.py `hot_auth_check`)."""
    hot_guard: Guard | None = rate_limit if hot_auth is None else hot_auth
    if hot_auth is not None and rate_limit is not None:

        def hot_guard(request: web.Request) -> Awaitable[None] | None:
            hot_auth(request)
            return rate_limit(request)

    return Edge(AccessLog(logger, fields, on_done, access_log), auth, rate_limit, hot_guard)


def edge_middleware(edge: Edge) -> web.middleware:
    """The edge for requests that came through the app's router."""

    @web.middleware
    async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await serve_logged(request, handler, edge.log, edge.guard, error_response_for)

    return edge_middleware


def hot_routes(app: web.Application) -> dict[str, tuple[Handler, UrlMappingMatchInfo]]:
    """`HOT_PATHS`' handlers, each with its route's match (what `request.match_info` is)."""
    hot: dict[str, tuple[Handler, UrlMappingMatchInfo]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else None
        if route.method == hdrs.METH_POST and path in HOT_PATHS:
            # One frozen match per route, shared by its requests: it holds no per-request
            # state (no path variables), as the router's own resolution would return.
            match = UrlMappingMatchInfo({}, route)
            match.add_app(app)
            match.freeze()
            hot[path] = (route.handler, match)  # type: ignore[assignment]
    return hot


def install_hot_paths(runner: web.AppRunner, edge: Edge) -> None:
    """Serve `HOT_PATHS` on `runner` (set up, not yet serving: connections accepted
    before this keep the app's way) through `edge` without the app's router."""
    server = runner.server
    assert server is not None, "install_hot_paths needs a runner that is set up"
    hot = hot_routes(runner.app)
    fallback = server.request_handler
    log, guard = edge.log, edge.hot_guard

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        found = hot.get(request.raw_path) if request.method == hdrs.METH_POST else None
        if found is None or hdrs.EXPECT in request.headers:
            return await fallback(request)
        handler, request._match_info = found  # type: ignore[attr-defined]
        return await serve_logged(request, handler, log, guard, error_response_for)  # type: ignore[arg-type]

    server.request_handler = dispatch
