"""A worker that costs next to nothing: for measuring routers, not workers.

    python -m loadtests.router.zero_worker PORT [--no-echo]

The sim worker spends ~0.5 ms of CPU per request (aiohttp, the engine loop), so on a
2-core machine it, not the router in front of it, sets the throughput a router bench
sees. This one is an asyncio protocol on uvloop that answers every POST at once with
one fixed completion (with `usage.prompt_tokens_details.cached_tokens`, as our workers
and stock engines report), and every GET (`/health`, `/v1/models`, `/get_model_info`,
`/get_server_info`) with a small JSON object: a few microseconds a request.

It echoes the request's `x-request-id` as our workers do, unless `--no-echo` (as a
stock engine without its switch): then routers that reuse connections only after an
echo (ours) open one per request. Requests must carry Content-Length (routers do); one
request at a time per connection, keep-alive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

COMPLETION = json.dumps({
    "id": "cmpl-zero", "object": "text_completion", "created": 0, "model": "sim",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 400, "completion_tokens": 4, "total_tokens": 404,
              "prompt_tokens_details": {"cached_tokens": 384}},
}).encode()  # fmt: skip
INFO = json.dumps({
    "status": "ok", "object": "list", "data": [{"id": "sim", "object": "model"}],
    "model_path": "sim", "is_generation": True, "max_total_num_tokens": 1_000_000,
}).encode()  # fmt: skip
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_ID = re.compile(rb"\r\nx-request-id:\s*([^\r]*)", re.IGNORECASE)
MAX_HEAD = 65536


class ZeroWorker(asyncio.Protocol):
    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self.transport.close()  # type: ignore[union-attr]
                return
            head = self.buffer[:end]
            found = _LENGTH.search(head)
            length = int(found[1]) if found else 0
            if len(self.buffer) < end + 4 + length:
                return  # the body is still coming
            self.buffer = self.buffer[end + 4 + length :]
            self.answer(head)

    def answer(self, head: bytes) -> None:
        body = COMPLETION if head.startswith(b"POST") else INFO
        rid = _ID.search(head) if self.echo else None
        echo = b"x-request-id: %s\r\n" % rid[1] if rid is not None else b""
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (echo, len(body), body)
        )


async def serve(port: int, echo: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ZeroWorker(echo), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--no-echo", action="store_true", help="do not echo x-request-id")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port, not args.no_echo))


if __name__ == "__main__":
    main()
