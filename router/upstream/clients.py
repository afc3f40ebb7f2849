"""Build the inference path's upstream client (`upstream_client`, shared/config.py): the
project's own (`own`, router/upstream/pool.py) or aiohttp's behind the same interface
(`aiohttp`, router/upstream/aiohttp_transport.py). The interface and the rules both keep
are in router/upstream/transport.py."""

from __future__ import annotations

from typing import Literal

from aiohttp.abc import AbstractResolver

from router.upstream.aiohttp_transport import AiohttpTransport
from router.upstream.pool import UpstreamPool
from router.upstream.transport import Transport


def make_transport(
    kind: Literal["own", "aiohttp"],
    resolver: AbstractResolver,
    connect_timeout: float,
    read_timeout: float,
    max_buffered: int,
    max_buffered_total: int,
) -> Transport:
    if kind == "aiohttp":
        return AiohttpTransport(
            resolver, connect_timeout, read_timeout, max_buffered,
            max_buffered_total=max_buffered_total,
        )  # fmt: skip
    return UpstreamPool(
        resolver, connect_timeout, read_timeout, max_buffered,
        max_buffered_total=max_buffered_total,
    )  # fmt: skip
