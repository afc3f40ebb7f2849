"""API keys: Bearer tokens for clients, a separate admin key for changing the fleet.

Keys are compared in constant time, and against every configured key (no early exit),
so the response time says nothing about how much of a key matched. Keys are never
logged.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from aiohttp import web

from shared.config import RouterConfig
from shared.errors import APIError, Handler

OPEN_PATHS = frozenset({"/openapi.json"})
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard.json"})
# Pages a browser opens: it cannot send a Bearer header, so the key is also taken as the
# password of HTTP Basic auth, and a refusal asks the browser to prompt for it.
BROWSER_PATHS = frozenset({"/dashboard", "/dashboard.json"})


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def basic_password(request: web.Request) -> str | None:
    """The password of `Authorization: Basic base64(user:password)` (the user is ignored)."""
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    password = decoded.partition(":")[2]
    return password or None


def key_matches(token: str | None, keys: tuple[str, ...]) -> bool:
    if token is None:
        return False
    given = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def is_admin_request(request: web.Request) -> bool:
    # Only methods that change the fleet; others fall through to 405 from the router table.
    return request.path.startswith("/workers") and request.method in (
        "POST",
        "PUT",
        "PATCH",
        "DELETE",
    )


def make_auth_middleware(config: RouterConfig) -> web.middleware:
    admin_keys = (config.admin_key,) if config.admin_key else ()

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or (path in OBSERVABILITY_PATHS and not config.protect_metrics):
            return await handler(request)
        token = bearer_token(request)
        if token is None and path in BROWSER_PATHS:
            token = basic_password(request)
        if is_admin_request(request):
            if not admin_keys:
                raise APIError(
                    403, "the admin API is disabled: set admin_key", code="admin_disabled"
                )
            if not key_matches(token, admin_keys):
                raise APIError(401, "a valid admin key is required", code="invalid_api_key")
            return await handler(request)
        if config.api_keys and not key_matches(token, config.api_keys + admin_keys):
            browser = path in BROWSER_PATHS
            raise APIError(
                401,
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Basic realm="radix-router"' if browser else "Bearer"},
            )
        return await handler(request)

    return auth_middleware
