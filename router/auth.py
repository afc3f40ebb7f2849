"""API keys: Bearer tokens for clients, a separate admin key for changing the fleet.

Keys are compared in constant time, and against every configured key (no early exit),
so the response time says nothing about how much of a key matched. Keys are never
logged.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from shared.config import RouterConfig
from shared.errors import APIError, Handler

# Probes must answer the kubelet, which has no key.
OPEN_PATHS = frozenset({"/openapi.json", "/liveness", "/readiness"})
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics"})


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


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
        if is_admin_request(request):
            if not admin_keys:
                raise APIError(
                    403, "the admin API is disabled: set admin_key", code="admin_disabled"
                )
            if not key_matches(token, admin_keys):
                raise APIError(401, "a valid admin key is required", code="invalid_api_key")
            return await handler(request)
        if config.api_keys and not key_matches(token, config.api_keys + admin_keys):
            raise APIError(
                401,
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth_middleware
