"""The inference endpoints: OpenAI completions and chat, and SGLang's `/generate`.

Each handler validates its body with the shared pydantic models, builds one engine
`GenerateRequest` and a formatter for its wire format; `_run` does the rest the same
way for all three: the first engine output is awaited before any byte is sent, so a
request the engine refuses (prompt too long, queue full) still gets a clean 4xx/503,
then the answer is returned whole or streamed as SSE. The engine stream is always
closed (`aclosing`), so a client that disconnects aborts its request and frees its KV.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from aiohttp import web
from pydantic import ValidationError

from shared import openai_responses as wire
from shared.body import read_json
from shared.errors import APIError
from shared.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateSamplingParams,
    GenerateWireRequest,
)
from worker.engine.types import EngineError, EngineOverloaded, GenerateOutput, SamplingParams
from worker.engine.types import GenerateRequest as EngineRequest
from worker.state import CONFIG, ENGINE, METRICS, STATE
from worker.streaming import open_stream, send_done, send_event, send_events


class _Format(Protocol):
    """How one endpoint renders engine outputs."""

    def body(self, text: str, ids: list[int], last: GenerateOutput) -> dict[str, Any]: ...
    def chunks(self, out: GenerateOutput, first: bool) -> list[dict[str, Any]]: ...
    def usage_chunk(self, last: GenerateOutput) -> dict[str, Any] | None: ...


def _usage(out: GenerateOutput) -> dict[str, Any]:
    return wire.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


class _CompletionFormat:
    def __init__(self, rid: str, model: str, echo: str, include_usage: bool) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.echo, self.include_usage = echo, include_usage

    def body(self, text: str, ids: list[int], last: GenerateOutput) -> dict[str, Any]:
        return wire.completion_body(
            self.rid, self.model, self.created, self.echo + text, last.finish_reason, _usage(last)
        )

    def chunks(self, out: GenerateOutput, first: bool) -> list[dict[str, Any]]:
        text = (self.echo if first else "") + out.text_delta
        if not text and not out.finished:
            return []
        return [wire.completion_chunk(self.rid, self.model, self.created, text, out.finish_reason)]

    def usage_chunk(self, last: GenerateOutput) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        return wire.usage_chunk("text_completion", self.rid, self.model, self.created, _usage(last))


class _ChatFormat:
    def __init__(self, rid: str, model: str, include_usage: bool) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.include_usage = include_usage

    def body(self, text: str, ids: list[int], last: GenerateOutput) -> dict[str, Any]:
        return wire.chat_body(
            self.rid, self.model, self.created, text, last.finish_reason, _usage(last)
        )

    def chunks(self, out: GenerateOutput, first: bool) -> list[dict[str, Any]]:
        chunk = [] if not first else [self._chunk({"role": "assistant", "content": ""}, None)]
        if out.text_delta or out.finished:
            delta = {"content": out.text_delta} if out.text_delta else {}
            chunk.append(self._chunk(delta, out.finish_reason))
        return chunk

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return wire.chat_chunk(self.rid, self.model, self.created, delta, finish)

    def usage_chunk(self, last: GenerateOutput) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        obj = "chat.completion.chunk"
        return wire.usage_chunk(obj, self.rid, self.model, self.created, _usage(last))


class _SGLangFormat:
    """SGLang's `/generate`, streamed incrementally (as SGLang does with
    `--incremental-streaming-output`): each chunk holds only the new text and token ids,
    with `meta_info`. The cumulative form resent the whole text every chunk: 8k tokens
    sent 271 MB."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.ids: list[int] = []  # token ids not sent yet (their text is still partial)

    def body(self, text: str, ids: list[int], last: GenerateOutput) -> dict[str, Any]:
        return {"text": text, "output_ids": ids, "meta_info": self._meta(last)}

    def chunks(self, out: GenerateOutput, first: bool) -> list[dict[str, Any]]:
        self.ids.extend(out.token_ids)
        if not out.text_delta and not out.finished:
            return []
        ids, self.ids = self.ids, []
        return [{"text": out.text_delta, "output_ids": ids, "meta_info": self._meta(out)}]

    def _meta(self, out: GenerateOutput) -> dict[str, Any]:
        return {
            "id": self.rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": {"type": out.finish_reason} if out.finish_reason else None,
        }

    def usage_chunk(self, last: GenerateOutput) -> dict[str, Any] | None:
        return None


def _check_model(request: web.Request, model: str | None) -> str:
    """The served name; 404 for any other (requests without `model` are accepted)."""
    served = request.app[STATE].served_model
    if model is not None and model not in (served, request.app[CONFIG].model):
        raise APIError(
            404, f"the model {model!r} does not exist; this worker serves {served!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    return served


def _sampling(req: Any, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        seed=req.seed, stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )  # fmt: skip


def _engine_error(exc: Exception, params: dict[str, str]) -> APIError:
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"})
    assert isinstance(exc, EngineError)
    param = params.get(exc.param or "", exc.param)
    return APIError(400, exc.message, param=param, code=exc.code)


async def _run(
    request: web.Request,
    gen: EngineRequest,
    fmt: _Format,
    stream: bool,
    params: dict[str, str],
) -> web.StreamResponse:
    engine, metrics = request.app[ENGINE], request.app[METRICS]
    start = time.perf_counter()
    try:
        outputs = engine.generate(gen)
    except (EngineError, EngineOverloaded) as exc:
        raise _engine_error(exc, params) from None
    async with contextlib.aclosing(outputs) as it:  # type: ignore[type-var]
        try:
            first = await anext(it)
        except (EngineError, EngineOverloaded) as exc:
            raise _engine_error(exc, params) from None
        first_at = time.perf_counter()
        metrics.first_output(request.path, first_at - start, first.queue_seconds)
        if not stream:
            parts, ids, last = [first.text_delta], list(first.token_ids), first
            async for out in it:
                parts.append(out.text_delta)
                ids.extend(out.token_ids)
                last = out
            metrics.last_output(request.path, time.perf_counter() - first_at, last)
            return web.json_response(fmt.body("".join(parts), ids, last))
        response = await open_stream(request, request.app[CONFIG].stream_write_timeout)
        try:
            out, is_first = first, True
            while True:
                events = fmt.chunks(out, is_first)
                is_first = False
                if out.finished:  # the last delta leaves with usage and [DONE]
                    break
                await send_events(response, events)
                nxt = await anext(it, None)
                if nxt is None:
                    events = []
                    break
                out = nxt
            if (usage := fmt.usage_chunk(out)) is not None:
                events.append(usage)
            metrics.last_output(request.path, time.perf_counter() - first_at, out)
            await send_done(response, events)
        except ConnectionResetError:
            pass  # the client left; closing `it` aborts the request
        except (EngineError, EngineOverloaded, RuntimeError) as exc:
            # Headers are sent: the failure can only be told in the stream itself.
            message = exc.message if isinstance(exc, EngineError) else f"generation failed: {exc}"
            error = {"message": message, "type": "server_error", "param": None, "code": None}
            with contextlib.suppress(ConnectionResetError):
                await send_event(response, {"error": error})
                await send_done(response)
        return response


async def _read(request: web.Request) -> dict[str, Any]:
    config = request.app[CONFIG]
    _, body = await read_json(request, config.max_body_bytes, config.body_read_timeout)
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = CompletionRequest.model_validate(body)
    model = _check_model(request, req.model)
    text, ids = req.prompt_text(), req.prompt_ids()
    if req.echo and text is None:
        raise APIError(400, "echo needs a text prompt", param="echo", code="unsupported")
    rid = wire.new_request_id("cmpl")
    gen = EngineRequest(
        request_id=rid, prompt=text, prompt_token_ids=tuple(ids) if ids is not None else None,
        params=_sampling(req, req.max_tokens or 16),  # OpenAI's default for completions
    )  # fmt: skip
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = _CompletionFormat(rid, model, text if req.echo and text else "", include_usage)
    return await _run(request, gen, fmt, req.stream, {})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = ChatCompletionRequest.model_validate(body)
    model = _check_model(request, req.model)
    engine = request.app[ENGINE]
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt = engine.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt
        )
    except EngineError as exc:
        raise _engine_error(exc, {"prompt": "messages"}) from None
    max_tokens = req.effective_max_tokens
    if max_tokens is None:  # OpenAI: as much as the context leaves
        max_tokens = max(1, engine.max_model_len - engine.count_tokens(prompt))
    rid = wire.new_request_id("chatcmpl")
    gen = EngineRequest(request_id=rid, prompt=prompt, params=_sampling(req, max_tokens))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = _ChatFormat(rid, model, include_usage)
    max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return await _run(
        request, gen, fmt, req.stream, {"prompt": "messages", "max_tokens": max_param}
    )


async def generate(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = GenerateWireRequest.model_validate(body)
    try:
        sp = GenerateSamplingParams.model_validate(req.sampling_params)
    except ValidationError as exc:  # name the nested field: sampling_params.max_new_tokens
        first = exc.errors()[0]
        param = ".".join(["sampling_params", *map(str, first["loc"])])
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None
    rid = req.rid or wire.new_request_id("gen")
    gen = EngineRequest(
        request_id=rid, prompt=req.text,
        prompt_token_ids=tuple(req.input_ids) if req.input_ids is not None else None,
        params=_sampling(sp, sp.max_new_tokens),
    )  # fmt: skip
    prompt_param = "text" if req.text is not None else "input_ids"
    params = {
        "prompt": prompt_param,
        "max_tokens": "sampling_params.max_new_tokens",
        "stop_token_ids": "sampling_params.stop_token_ids",
        "temperature": "sampling_params.temperature",
        "top_p": "sampling_params.top_p",
        "top_k": "sampling_params.top_k",
    }
    return await _run(request, gen, _SGLangFormat(rid), req.stream, params)
