"""The worker's OpenAPI 3.1 document, generated from the same pydantic request models
the handlers validate with, so the document cannot drift from what is enforced."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shared.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

_REF = "#/components/schemas/{model}"

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _error(description: str) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/Error"}
    return {"description": description, "content": {"application/json": {"schema": ref}}}


_ERRORS = {
    "400": _error("Invalid request"),
    "401": _error("Missing or invalid API key"),
    "404": _error("Unknown model"),
    "413": _error("Request body too large"),
    "503": _error("Engine starting, overloaded or draining"),
}


def _inference(model: type[BaseModel], summary: str) -> dict[str, Any]:
    ok = {
        "description": "The answer (JSON), or server-sent events when `stream` is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {},
        },
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            },
            "responses": {"200": ok, **_ERRORS},
        }
    }


def _get(summary: str, *codes: str) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "OK",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
    for code in codes:
        responses[code] = _error(summary)
    return {"summary": summary, "responses": responses}


def openapi_document(served_model: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "radix-router worker",
            "version": "0.1.0",
            "description": f"Serves {served_model}",
        },
        "paths": {
            "/v1/chat/completions": _inference(ChatCompletionRequest, "OpenAI chat completion"),
            "/v1/completions": _inference(CompletionRequest, "OpenAI text completion"),
            "/generate": _inference(GenerateRequest, "SGLang native generation"),
            "/v1/models": {"get": _get("The served model", "401")},
            "/health": {"get": _get("200 when ready; 503 while starting or draining", "503")},
            "/get_server_info": {"get": _get("Worker identity, config and engine stats", "401")},
            "/flush_cache": {"post": _get("Drop every cached prefix", "401", "409", "503")},
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
