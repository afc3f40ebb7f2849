"""The router's upstream transport: one interface, two implementations.

The inference path talks to workers through a `Transport` and reads each answer through
an `Answer`; nothing else about the client leaks into the proxy. Two transports
implement it, selected by `upstream_client` (shared/config.py;
`router/upstream/clients.py` builds the one chosen):

- `own` (default): the hand-written HTTP/1.1 client on httptools
  (`router/upstream/pool.py`, `router/upstream/connection.py`), ~30% less router CPU per
  request than aiohttp's client (`loadtests/results/router_overhead.md`);
- `aiohttp`: aiohttp's `ClientSession` behind the same interface
  (`router/upstream/aiohttp_transport.py`), with the same rules added on top.

Both pass one conformance suite (`tests/router/upstream/test_transport_conformance.py`): the same
scripted worker bytes give the same outcome through either. The rules both keep:

- a connection is reused only when provably idle: after an answer that echoed the
  request's `x-request-id`, never for the id it last carried, and never after a byte
  nobody asked for (an answer to another request is a broken connection, not an answer);
- the head and a buffered body arrive within one overall deadline (`read_timeout`); a
  stream's waits are bounded one by one;
- a buffered answer holds at most `max_buffered` bytes, and all of them together at
  most the budget; a truncated body is `UpstreamBroken`, never a short answer.
"""

from __future__ import annotations

from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from router.upstream.echo import EchoBook
from router.upstream.limits import UpstreamBroken

__all__ = ["Answer", "Transport", "UpstreamBroken"]


class Answer(Protocol):
    """One worker answer whose head has arrived."""

    status: int
    headers: CIMultiDict[str] | CIMultiDictProxy[str] | None
    content_type: str  # lower case, no parameters
    content_length: int | None
    close_delimited: bool  # no length, not chunked: the body ends with the connection
    too_big: bool  # over the transport's max_buffered
    over_budget: bool  # over the budget of all buffered answers together

    async def read_all(self) -> bytes:
        """The whole body (`UpstreamBroken`, `TimeoutError`)."""
        ...

    def whole(self) -> bytes | None:
        """What `read_all` would return at once, where the whole body is here and sound;
        None where it would wait or raise (then `read_all`). Read once, as `read_all`."""
        ...

    async def readany(self) -> bytes:
        """What arrived since the last call, waiting if nothing did; b"" at the end."""
        ...

    def is_eof(self) -> bool: ...

    def close(self) -> None:
        """Abandon the answer: its connection is closed, never reused."""
        ...


class Transport(Protocol):
    stale_retries: int  # requests re-sent after a stale keep-alive connection
    connects: int  # connections opened
    echo: EchoBook  # per worker: do its answers echo the request id (router/upstream/echo.py)

    async def post(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        request_id: str,
        fresh: bool = False,
    ) -> Answer:
        """Send the request; return once the answer's head has arrived (`UpstreamBroken`,
        `ForeignAnswer`, `TimeoutError`). `fresh`: on a new connection, never a pooled one."""
        ...

    def release(self, base_url: str, answer: Answer) -> None:
        """The answer was read to its end: its connection may carry another request."""
        ...

    async def close(self) -> None: ...
