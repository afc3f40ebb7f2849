"""API keys: Bearer tokens for clients, a separate admin key for changing the fleet.

Parsing and comparing keys is `shared/serving/auth.py`, the same code the worker runs. Keys
are never logged.

The dashboard's two paths are where a browser navigates, and a browser cannot send a
Bearer header: there the key is also taken as the password of HTTP Basic auth, and a
refusal asks the browser to prompt for it (`WWW-Authenticate: Basic`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Collection

from aiohttp import web

from shared.config import RouterConfig
from shared.serving.auth import KeySet, unauthorized
from shared.serving.auth import bearer_token as _bearer_token
from shared.serving.errors import APIError

# Probes must answer the kubelet, which has no key.
OPEN_PATHS = frozenset({"/openapi.json", "/liveness", "/readiness"})
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard.json"})
BROWSER_PATHS = frozenset({"/dashboard", "/dashboard.json"})


def request_bearer_token(request: web.Request) -> str | None:
    return _bearer_token(request.headers)


def basic_password(request: web.Request) -> str | None:
    """The password of `Authorization: Basic base64(user:password)` (the user is ignored)."""
    scheme, _, encoded = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeError):
        return None
    return decoded.partition(":")[2] or None


def is_admin_request(request: web.Request) -> bool:
    # Only methods that change the fleet; others fall through to 405 from the router table.
    return request.path.startswith("/workers") and request.method in (
        "POST",
        "PUT",
        "PATCH",
        "DELETE",
    )


AuthCheck = Callable[[web.Request], None]


def make_auth_check(config: RouterConfig) -> AuthCheck:
    """Raises the 401/403 APIError a request without the key its path needs gets.

    A plain function run by the router's one middleware (router/http/edge.py), not a
    middleware of its own: a layer of coroutine per request less."""
    admin_keys = KeySet((config.admin_key,) if config.admin_key else ())
    # A tenant's keys are client keys too (router/queue/tenants.py): with any tenant
    # configured, a request needs a key.
    tenant_keys = tuple(key for tenant in config.tenants.values() for key in tenant.keys)
    client_keys = KeySet(
        config.api_keys + tenant_keys + ((config.admin_key,) if config.admin_key else ())
    )
    api_keys = bool(config.api_keys or tenant_keys)

    def check(request: web.Request) -> None:
        path = request.path
        if path in OPEN_PATHS or (path in OBSERVABILITY_PATHS and not config.protect_metrics):
            return
        admin = is_admin_request(request)
        if not admin and not api_keys:
            return  # no client keys configured: nothing to parse or compare
        token = request_bearer_token(request)
        browser = path in BROWSER_PATHS
        if token is None and browser:
            token = basic_password(request)
        if admin:
            if not admin_keys:
                raise APIError(
                    403, "the admin API is disabled: set admin_key", code="admin_disabled"
                )
            if not admin_keys.matches(token):
                raise APIError(401, "a valid admin key is required", code="invalid_api_key")
            return
        if not client_keys.matches(token):
            refusal = unauthorized()
            if browser:
                refusal.headers["WWW-Authenticate"] = 'Basic realm="radix-router"'
            raise refusal

    return check


def hot_auth_check(
    config: RouterConfig, check: AuthCheck, paths: Collection[str]
) -> AuthCheck | None:
    """`check` for POSTs to `paths` (the inference routes: none of them open, an
    observability, browser or admin path), or None where it lets every such request
    through: no client key configured (then `check` returns before reading a header)."""
    for path in paths:
        if path in OPEN_PATHS or path in OBSERVABILITY_PATHS or path.startswith("/workers"):
            raise ValueError(f"{path} is not an inference path")
    tenant_keys = any(tenant.keys for tenant in config.tenants.values())
    return check if config.api_keys or tenant_keys else None
