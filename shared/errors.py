"""OpenAI-shaped errors and the aiohttp middleware that guarantees them.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}`
with a matching HTTP status, whichever service answers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

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


def validation_error(e: ValidationError) -> APIError:
    """The first problem, with the field path as `param` (what OpenAI's API does)."""
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw request body, or a 413 APIError once it exceeds `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.content.iter_chunked(65536):
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    return bytes(body)


def parse_json_object(raw: bytes) -> dict:
    """`raw` as a JSON object, or a 400 APIError saying what is wrong with it."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"request body is not valid JSON: {e.msg} at position {e.pos}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return data


async def read_json(request: web.Request, limit: int) -> dict:
    """The request body as a JSON object, or an APIError (413 over `limit`, 400 otherwise)."""
    return parse_json_object(await read_body(request, limit))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except ValidationError as e:
        return error_response(validation_error(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(
            error_body(e.status, e.reason or "error"),
            status=e.status,
            headers={k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")},
        )
    except Exception:
        # A bug must not kill the process nor leak a traceback to the client.
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body(500, "internal server error"), status=500)
