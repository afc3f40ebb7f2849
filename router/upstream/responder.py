"""How the proxy's answer reaches the client, whichever server took the request.

The proxy relays a worker's answer through a `Responder`, one of two:

- aiohttp's (`AIOHTTP`, the default): a buffered answer is a `web.Response`, a stream a
  `DeadlineStream` (shared/serving/http.py); aiohttp's server frames them;
- the router's own protocol's (router/http/fast_answer.py `FastResponder`), for the
  requests it serves itself (router/http/fast_server.py): it frames the answer itself,
  one socket write for a buffered answer, HTTP chunked for a stream, with aiohttp's
  header rules.

A request carries its responder under `RESPONDER` (the own protocol sets it); a request
without one is aiohttp's. So the proxy never asks which server it runs under.

What either responder's answer is to the rest of the router (`Reply`): its `status` and
`headers`, read by the handler, the edge's counts and the access-log line
(shared/serving/access_log.py). A stream (`StreamReply`) is prepared (the apps'
`on_response_prepare` hooks run: the request id header, the fleet queue's first byte;
its head leaves with the first chunk), written chunk by chunk, each write bounded by
the stream write deadline (a client that does not read within it is aborted and the
write raises `ConnectionResetError`, as if it had left), and ended by `write_eof`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from shared.serving.http import DeadlineStream, request_key


class Reply(Protocol):
    """An answer as the handler, the counts and the access log see it."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


class StreamReply(Reply, Protocol):
    """A streamed answer: `prepare`, then `write` per chunk, then `write_eof`."""

    async def prepare(self, request: Any) -> Any: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


class Responder(Protocol):
    """Makes the proxy's answers for one server."""

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> Reply:
        """A buffered answer: `body` whole, framed with its length."""
        ...

    def stream(
        self, request: Any, status: int, headers: CIMultiDict[str], write_timeout: float
    ) -> StreamReply:
        """A streamed answer whose every write is taken within `write_timeout` seconds."""
        ...


class AiohttpResponder:
    """aiohttp's response objects: its server frames them."""

    __slots__ = ()

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> web.Response:
        return web.Response(body=body, status=status, headers=headers)

    def stream(
        self, request: Any, status: int, headers: CIMultiDict[str], write_timeout: float
    ) -> DeadlineStream:
        return DeadlineStream(request, write_timeout, status=status, headers=headers)


AIOHTTP = AiohttpResponder()
RESPONDER = request_key("responder")  # the request's own responder, where not aiohttp's


def responder_of(request: Any) -> Responder:
    """The responder of the server that took `request` (aiohttp's unless it says)."""
    return request.get(RESPONDER, AIOHTTP)  # type: ignore[no-any-return]
