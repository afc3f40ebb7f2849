"""The inference endpoints: OpenAI completions and chat, and SGLang's `/generate`.

Each handler validates its body with the shared pydantic models, builds one
`EngineRequest` (worker/http/intake.py) and a formatter for its wire format (worker/http/formats.py); `_answer` does the rest the same
way for all three: the first engine output is awaited before any byte is sent, so a
request the engine refuses (prompt too long, queue full) still gets a clean 4xx/503,
then the answer is returned whole or streamed as SSE. The engine stream is always
closed (`aclosing`), so a client that disconnects aborts its request and frees its KV.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from shared.serving.body import read_json
from shared.serving.errors import APIError
from shared.wire import openai_responses as wire
from shared.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateSamplingParams,
    GenerateWireRequest,
)
from shared.wire.service_class import request_class
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineRequest,
    GenerateOutput,
)
from worker.http.formats import (
    ChatFormat,
    Choice,
    CompletionFormat,
    Format,
    SGLangFormat,
    Tally,
    TokenBytes,
)
from worker.http.intake import (
    check_model,
    refuse_unsupported,
    sampling_params,
    session_pin,
)
from worker.http.state import CONFIG, ENGINE, METRICS
from worker.http.streaming import Event, open_stream, send_done, send_events


def _engine_error(exc: Exception, params: dict[str, str]) -> APIError:
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"})
    assert isinstance(exc, EngineError)
    param = params.get(exc.param or "", exc.param)
    return APIError(400, exc.message, param=param, code=exc.code)


async def _answer(
    request: web.Request,
    gen: EngineRequest,
    fmt: Format,
    stream: bool,
    params: dict[str, str],
    pin: dict[str, Any] | None = None,
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
        tally = Tally()
        tally.pin = pin
        if not stream:
            choices = [Choice(i) for i in range(gen.params.n)]
            out: GenerateOutput | None = first
            last = first
            while out is not None:
                choices[out.index].add(out)
                tally.add(out)
                last = out
                out = await anext(it, None)
            metrics.last_output(request.path, time.perf_counter() - first_at, last)
            return web.json_response(fmt.body(choices, tally))
        response = await open_stream(request, request.app[CONFIG].stream_write_timeout)
        events: list[Event] = []  # ready, not sent yet
        try:
            started: set[int] = set()
            unfinished = gen.params.n
            out = first
            while True:
                tally.add(out)
                events += fmt.chunks(out, out.index not in started)
                started.add(out.index)
                unfinished -= out.finished
                if not unfinished:  # the last delta leaves with usage and [DONE]
                    break
                if not outputs.ready():  # else the next output joins this write
                    await send_events(response, events)
                    events = []
                nxt = await anext(it, None)
                if nxt is None:
                    break
                out = nxt
            if (usage := fmt.usage_chunk(tally)) is not None:
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
                await send_done(response, [*events, {"error": error}])
        return response


async def _read(request: web.Request) -> dict[str, Any]:
    config = request.app[CONFIG]
    _, body = await read_json(request, config.max_body_bytes, config.body_read_timeout)
    return body


def _token_bytes(request: web.Request) -> TokenBytes:
    return request.app[ENGINE].token_bytes


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = CompletionRequest.model_validate(body)
    refuse_unsupported(body)
    model = check_model(request, req.model, body)
    text, ids = req.prompt_text(), req.prompt_ids()
    if req.echo and text is None:
        raise APIError(400, "echo needs a text prompt", param="echo", code="unsupported")
    rid = wire.new_request_id("cmpl")
    klass, priority = request_class(body)
    gen = EngineRequest(
        request_id=rid, prompt=text, prompt_token_ids=tuple(ids) if ids is not None else None,
        params=sampling_params(  # 16: OpenAI's default for completions
            req, req.max_tokens or 16, req.logprobs is not None, req.logprobs or 0
        ),
        cache_salt=req.cache_salt,
        priority=priority,
    )  # fmt: skip
    gen, pin = session_pin(request, req, gen, klass)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = text if req.echo and text else ""
    fmt = CompletionFormat(rid, model, echo, include_usage, _token_bytes(request))
    return await _answer(request, gen, fmt, req.stream, {}, pin)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = ChatCompletionRequest.model_validate(body)
    refuse_unsupported(body)
    model = check_model(request, req.model, body)
    engine = request.app[ENGINE]
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        prompt = engine.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt
        )
    except EngineError as exc:
        raise _engine_error(exc, {"prompt": "messages"}) from None
    ids = engine.tokenize(prompt)  # once: the engine runs these ids
    max_tokens = req.effective_max_tokens
    if max_tokens is None:  # OpenAI: as much as the context leaves
        max_tokens = max(1, engine.max_model_len - len(ids))
    rid = wire.new_request_id("chatcmpl")
    if req.top_logprobs and not req.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    params = sampling_params(req, max_tokens, req.logprobs, req.top_logprobs or 0)
    klass, priority = request_class(body)
    gen, pin = session_pin(
        request, req, EngineRequest(
            request_id=rid, prompt_token_ids=tuple(ids), params=params, priority=priority,
            cache_salt=req.cache_salt,
        ), klass,
    )  # fmt: skip
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = ChatFormat(rid, model, include_usage, _token_bytes(request))
    max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return await _answer(
        request, gen, fmt, req.stream, {"prompt": "messages", "max_tokens": max_param}, pin
    )


async def generate(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = GenerateWireRequest.model_validate(body)
    check_model(request, None, body)  # SGLang's `lora_path`
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
        params=sampling_params(sp, sp.max_new_tokens),
        priority=request_class(body)[1],
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
    return await _answer(request, gen, SGLangFormat(rid), req.stream, params)
