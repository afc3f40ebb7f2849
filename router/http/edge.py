"""The router's one middleware: request id, access log and counts, OpenAI-shaped
errors, API keys and the rate limit, in the order four middlewares used to run them.

Per request, outermost first:

1. the request id (`shared/serving/access_log.py`) and the start time;
2. the API-key check (`router/http/auth.py`), then the rate limit (`router/http/ratelimit.py`);
3. the handler;
4. anything raised by 2 or 3 becomes its OpenAI-shaped answer (`shared/serving/errors.py`);
5. when the request ends (answered, failed, or the client left: 499), `on_done` counts
   it and the access-log line is written.

Why one: aiohttp runs each middleware as a coroutine wrapped around the next, so four
of them cost four frames, four `await`s and four try blocks per request on the hot
path; here the checks are plain calls. The worker keeps the separate middlewares.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from router.http.auth import AuthCheck
from router.http.ratelimit import RateLimitCheck
from shared.serving.access_log import (
    REQUEST_ID,
    REQUEST_ID_HEADER,
    OnDone,
    log_access,
    request_id_of,
)
from shared.serving.errors import Handler, error_response_for


def make_edge_middleware(
    logger: logging.Logger,
    fields: tuple[tuple[str, str], ...],
    on_done: OnDone,
    auth: AuthCheck,
    rate_limit: RateLimitCheck | None,
    access_log: bool = True,
) -> web.middleware:
    """`fields`: (log name, response header) pairs added to the access-log line."""

    @web.middleware
    async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[REQUEST_ID] = request_id_of(request.headers.get(REQUEST_ID_HEADER))
        start = time.perf_counter()
        status, response = 500, None
        try:
            try:
                auth(request)
                if rate_limit is not None:
                    await rate_limit(request)
                response = await handler(request)
            except Exception as e:
                response = error_response_for(request, e)
                if response is None:  # a redirect: not an error, aiohttp sends it
                    raise
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's convention)
            raise
        finally:
            seconds = time.perf_counter() - start
            on_done(request, status, seconds, response)
            if access_log and logger.isEnabledFor(logging.INFO):
                log_access(logger, fields, request, status, seconds, response)

    return edge_middleware
