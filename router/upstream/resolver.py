"""DNS for worker URLs, held to the same rule as literal addresses (`shared/wire/peers.py`).

A worker URL names a host; aiohttp resolves DNS names (literals it dials as they are,
and those were checked when the URL was accepted). This resolver drops every address
`address_refusal` refuses (link-local, metadata, outside `worker_url_allow_cidrs`), so
a name registered in Redis cannot point the router at what a literal could not, nor
turn into such an address later (a rebinding DNS record). No address left: the connect
fails like any unreachable worker.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from shared.wire.peers import Network, address_refusal

log = logging.getLogger(__name__)


class GuardedResolver(AbstractResolver):
    def __init__(self, allow: tuple[Network, ...] = (), inner: AbstractResolver | None = None):
        self.allow = allow
        self.inner = inner if inner is not None else DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        kept: list[ResolveResult] = []
        for result in results:
            why = address_refusal(ipaddress.ip_address(result["host"]), self.allow)
            if why is None:
                kept.append(result)
            else:
                log.warning(
                    "worker host %r resolves to %s (%s): refused", host, result["host"], why
                )
        if not kept:
            raise OSError(f"worker host {host!r} resolves to no allowed address")
        return kept

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the connector asks
        return getattr(self.inner, name)
