"""OpenAI-shaped errors and the aiohttp middleware that guarantees them.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}`
with a matching HTTP status, whichever service answers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from shared.serving.http import request_key

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(
        error_body(err.status, err.message, err.param, err.code),
        status=err.status,
        headers=err.headers,
    )


_UNION_MEMBER = re.compile(r"[\[\]-]|^(str|int|float|bool|list|dict|none|function-after)$")


def _client_path(loc: tuple[int | str, ...]) -> str | None:
    # Union members show up in the location ("prompt.str", "prompt.list[int]"); a client
    # only knows field names and list indexes.
    parts = [str(p) for p in loc if isinstance(p, int) or not _UNION_MEMBER.search(str(p))]
    return ".".join(parts) or None


def validation_error(e: ValidationError) -> APIError:
    """The first bad field, with its path as `param` (what OpenAI's API does).

    When the field is a union, every alternative's complaint is listed, so the client
    learns what would have been accepted.
    """
    errors = e.errors()
    if errors[0]["type"] == "unrecognized_argument":  # shared/wire/protocol.py
        name = str(errors[0].get("ctx", {}).get("name", ""))
        return APIError(400, errors[0]["msg"], param=name or None, code="unknown_parameter")
    param = _client_path(errors[0]["loc"])
    same = [
        err for err in errors if _client_path(err["loc"][:1]) == _client_path(errors[0]["loc"][:1])
    ]
    msgs = list(dict.fromkeys(
        "unknown field" if err["type"] == "extra_forbidden" else err["msg"] for err in same
    ))  # fmt: skip
    msg = msgs[0] if len(msgs) == 1 else "none of the accepted forms matched: " + "; ".join(msgs)
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Where the APIError's `code` is left for the hooks that count refusals by it (the
# router's access hook) without parsing the body back.
ERROR_CODE = request_key("error_code")


def error_response_for(request: web.Request, e: Exception) -> web.Response | None:
    """The OpenAI-shaped answer to what a handler raised; None for a non-error
    HTTPException (a redirect), which the caller re-raises. Call it from the `except`
    block: a bug is logged with its traceback."""
    if isinstance(e, APIError):
        request[ERROR_CODE] = e.code
        return error_response(e)
    if isinstance(e, ValidationError):
        return error_response(validation_error(e))
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            return None
        return web.json_response(
            error_body(e.status, e.reason or "error"),
            status=e.status,
            headers={k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")},
        )
    # A bug must not kill the process nor leak a traceback to the client.
    log.exception("unhandled error on %s %s", request.method, request.path)
    return web.json_response(error_body(500, "internal server error"), status=500)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as e:
        response = error_response_for(request, e)
        if response is None:
            raise
        return response
