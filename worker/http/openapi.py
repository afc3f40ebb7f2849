"""The worker's OpenAPI 3.1 document, generated from the same pydantic request models
the handlers validate with, so the document cannot drift from what is enforced."""

from __future__ import annotations

from typing import Any

from shared.serving.openapi import ERROR_SCHEMA, add_schema, error_spec, inference_operation
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateWireRequest

_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or invalid API key",
    "404": "Unknown model",
    "408": "Request body not received within body_read_timeout",
    "413": "Request body too large",
    "415": "Content-Encoding other than gzip or deflate",
    "503": "Engine starting, overloaded or draining",
}


def _served_inference(ref: dict[str, Any], summary: str) -> dict[str, Any]:
    ok = "The answer (JSON), or server-sent events when `stream` is true"
    return inference_operation(ref, summary, ok, _ERRORS)


def _json_operation(summary: str, *codes: str) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "OK",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
    for code in codes:
        responses[code] = error_spec(summary)
    return {"summary": summary, "responses": responses}


def openapi_document(served_model: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}
    chat = add_schema(ChatCompletionRequest, schemas)
    completion = add_schema(CompletionRequest, schemas)
    generate = add_schema(GenerateWireRequest, schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "radix-router worker",
            "version": "0.1.0",
            "description": f"Serves {served_model}",
        },
        "paths": {
            "/v1/chat/completions": _served_inference(chat, "OpenAI chat completion"),
            "/v1/completions": _served_inference(completion, "OpenAI text completion"),
            "/generate": _served_inference(generate, "SGLang native generation"),
            "/v1/models": {"get": _json_operation("The served model", "401")},
            "/health": {
                "get": _json_operation("200 when ready; 503 while starting or draining", "503")
            },
            "/get_server_info": {
                "get": _json_operation("Worker identity, config and engine stats", "401")
            },
            "/flush_cache": {
                "post": _json_operation("Drop every cached prefix", "401", "409", "503")
            },
            "/release_pin": {
                "post": _json_operation(
                    "Release a prompt_cache_key's pin (its session moved)",
                    "400",
                    "401",
                    "413",
                    "503",
                )
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": schemas},
    }
