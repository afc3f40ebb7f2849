"""A tiny aiohttp upstream that behaves like a worker, or like a broken one on demand.

Real workers cannot fail on cue (hang after accepting, 503 before the first byte, die
mid-stream), so proxy fault tests use this. Behaviour is picked per server by `mode`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

MODES = ("ok", "fail503", "hang", "break_midstream", "bad_request", "slow_stream")


@dataclass
class FakeWorker:
    name: str
    mode: str = "ok"
    cached_tokens: int = 7
    stream_chunks: int = 5
    chunk_delay: float = 0.0
    seen: int = 0
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    bodies_seen: list[dict] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    models_answer: object = None  # what GET /v1/models answers; None: this worker's model

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/generate", self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def models(self, request: web.Request) -> web.Response:
        if self.models_answer is not None:
            return web.json_response(self.models_answer)
        return web.json_response(
            {"object": "list", "data": [{"id": f"model-{self.name}", "object": "model"}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _usage(self) -> dict:
        return {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        self.headers_seen.append(dict(request.headers))
        body = await request.json()
        self.bodies_seen.append(body)
        try:
            if self.mode == "fail503":
                return web.json_response({"error": {"message": "busy"}}, status=503)
            if self.mode == "bad_request":
                return web.json_response(
                    {"error": {"message": "no", "type": "invalid_request_error"}}, status=400
                )
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if body.get("stream"):
                return await self._stream(request)
            self.completed += 1
            return web.json_response(
                {"id": "x", "object": "text_completion", "worker": self.name,
                 "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}], "usage": self._usage()},
                headers={"X-Upstream": self.name, "Connection": "keep-alive", "Keep-Alive": "timeout=5"},
            )  # fmt: skip
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Upstream": self.name}
        )
        await resp.prepare(request)
        for i in range(self.stream_chunks):
            chunk = {"id": "x", "choices": [{"index": 0, "text": f"t{i} "}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.mode == "break_midstream" and i == 1:
                assert request.transport is not None
                request.transport.abort()  # the worker process "dies"
                return resp
            delay = self.chunk_delay or (0.2 if self.mode == "slow_stream" else 0.0)
            if delay:
                await asyncio.sleep(delay)
        final = {"id": "x", "choices": [], "usage": self._usage()}
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        self.completed += 1
        return resp
