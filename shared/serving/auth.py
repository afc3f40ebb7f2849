"""Bearer keys, parsed and compared the same way by the router and the worker.

- The scheme is case-insensitive (`Bearer`, `bearer`: RFC 9110 §11.1) and the token is
  what follows it, surrounding spaces removed.
- A header whose bytes are not UTF-8 (aiohttp hands them over surrogate-escaped) holds
  no key: the caller answers 401, never 500.
- Keys are compared as SHA-256 digests, every configured key every time (no early exit),
  so neither how much of a key matched nor how long the keys are shows in the timing;
  `hmac.compare_digest` on strings of different lengths returns at once.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from shared.serving.errors import APIError


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    header = headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:  # surrogate-escaped bytes: not a key anyone was given
        return None
    return token


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


class KeySet:
    """The keys a service accepts, kept as digests (built once from the frozen config)."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def matches(self, token: str | None) -> bool:
        if token is None:
            return False
        given = _digest(token)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(given, digest)
        return found

    def allows(self, headers: Mapping[str, str]) -> bool:
        return self.matches(bearer_token(headers))


def unauthorized() -> APIError:
    """The one 401 both services answer a missing or wrong client key with."""
    return APIError(
        401,
        "a valid API key is required (Authorization: Bearer <key>)",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
