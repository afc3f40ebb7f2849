"""Request ids and the access log, the same in both services.

Every request gets an id: the client's `x-request-id` when it is a plain token (at most
128 characters of `[A-Za-z0-9._:-]`: the header is untrusted and ends up in logs),
else a new random one. The id is answered in `x-request-id`, forwarded by the router
to the worker (so one id names a request in both services' logs), and printed on one
access-log line per request when it ends:

    request_id=3f2a… method=POST path=/v1/chat/completions status=200 ms=41.3 worker=w1 route=cache_hit

Never the prompt, the answer or a credential: only the method, path, status, duration
and the routing headers the service names (`fields`). Streams are logged when they
end, with their whole duration. Logged at INFO on the `<service>.access` logger, so
an operator can route or silence it like any other logger: a line costs about 20 µs
of CPU (20,000 formatted lines to /dev/null through a StreamHandler, this machine),
a noticeable part of the router's 0.3 ms per-request budget, so `access_log: false`
(both services' config) turns the lines off; request ids stay.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from aiohttp import web

from shared.serving.errors import Handler
from shared.serving.http import request_key

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = request_key("request_id")  # the key in the aiohttp request's dict
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# (request, status, seconds, response or None): what a service counts per request.
OnDone = Callable[[web.Request, int, float, web.StreamResponse | None], None]


# A new id is this process's random prefix and a serial number, not 128 random bits
# per request: `os.urandom` was a getrandom syscall a request (0.34 against 0.21 us,
# timeit). Ids are correlation ids, never secrets: a client may send any id it likes
# (two clients the same one), so nothing may rely on one being unguessable, and nothing
# does (the upstream pool only needs the id it sends to differ from the connection's
# last one: router/upstream/connection.py). Unique across processes and replicas by
# the 64-bit random prefix, drawn again in a forked child. The ids are made in C, one
# format of one count (prefix << 64) + serial: 0.25 against 0.33 us for an f-string (timeit).
def _new_ids() -> Iterator[str]:
    return map("%032x".__mod__, itertools.count(int.from_bytes(os.urandom(8)) << 64))


_ids = _new_ids()


def _new_prefix() -> None:
    global _ids
    _ids = _new_ids()


os.register_at_fork(after_in_child=_new_prefix)


def fresh_request_id() -> str:
    """32 hex digits, as uuid4().hex: the process's prefix, then the serial number."""
    return next(_ids)


def request_id_of(headers_value: str | None) -> str:
    if headers_value is not None and _VALID_ID.fullmatch(headers_value):
        return headers_value
    return next(_ids)  # `fresh_request_id()`, inlined: a call less


async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every answer, streamed or not, error or not, carries the id."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid


def log_access(
    logger: logging.Logger,
    fields: tuple[tuple[str, str], ...],
    request: web.Request,
    status: int,
    seconds: float,
    response: web.StreamResponse | None,
) -> None:
    """The request's one access-log line (the caller checked `isEnabledFor(INFO)`)."""
    extra = ""
    if response is not None:
        for name, header in fields:
            value = response.headers.get(header)
            if value is not None:
                extra += f" {name}={value}"
    logger.info(
        "request_id=%s method=%s path=%s status=%d ms=%.1f%s",
        request[REQUEST_ID], request.method, request.path, status, seconds * 1e3, extra,
    )  # fmt: skip


# Run before the handler, inside the error mapping (the router's API-key check and rate
# limit): None when it is done, else an awaitable to finish it (a shared rate limit).
Guard = Callable[[web.Request], Awaitable[None] | None]
# A failed handler's answer (shared/serving/errors.py `error_response_for`), or None:
# the exception goes on up (a redirect, which aiohttp sends).
OnError = Callable[[web.Request, Exception], web.StreamResponse | None]


@dataclass(frozen=True, slots=True)
class AccessLog:
    """What a service logs and counts per request: the access-log line on `logger` with
    `fields` ((log name, response header) pairs added when present), unless not
    `enabled`, and `on_done` (the service's counts), if any."""

    logger: logging.Logger
    fields: tuple[tuple[str, str], ...] = ()
    on_done: OnDone | None = None
    enabled: bool = True


async def serve_logged(
    request: web.Request,
    handler: Handler,
    log: AccessLog,
    guard: Guard | None = None,
    on_error: OnError | None = None,
) -> web.StreamResponse:
    """One request's whole edge, in both services: its id and start time, then `guard`
    and the handler (what either raises becomes `on_error`'s answer, where one is
    given), and when it ends (answered, failed, or the client left: 499) `on_done` and
    the access-log line. One function, not a middleware per concern: aiohttp runs each
    middleware as one more coroutine around the next. The router's own protocol runs
    these steps inline (router/http/fast_server.py `FastProtocol._answer`: one coroutine
    a request less), held to this way by tests/router/http/test_hot_paths.py."""
    request[REQUEST_ID] = request_id_of(request.headers.get(REQUEST_ID_HEADER))
    start = time.perf_counter()
    status, response = 500, None
    try:
        try:
            if guard is not None:
                pending = guard(request)
                if pending is not None:
                    await pending
            response = await handler(request)
        except Exception as e:
            if on_error is None:
                raise
            response = on_error(request, e)
            if response is None:
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
        if log.on_done is not None:
            log.on_done(request, status, seconds, response)
        if log.enabled and log.logger.isEnabledFor(logging.INFO):
            log_access(log.logger, log.fields, request, status, seconds, response)


def make_access_middleware(
    logger: logging.Logger,
    fields: tuple[tuple[str, str], ...] = (),
    on_done: OnDone | None = None,
    enabled: bool = True,
) -> web.middleware:
    """`fields`: (log name, response header) pairs added to the line when present."""
    log = AccessLog(logger, fields, on_done, enabled)

    @web.middleware
    async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await serve_logged(request, handler, log)

    return access_middleware
