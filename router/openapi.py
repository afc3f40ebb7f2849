"""The router's OpenAPI document, generated from shared/protocol's pydantic models.

Schemathesis fuzzes the router against this document, so every status an endpoint
can answer is listed, with the OpenAI error shape for the 4xx/5xx ones.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shared.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
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
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _inference(ref: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {
                "200": {
                    "description": "The worker's answer (JSON, or SSE when stream is true)",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {},
                    },
                },
                "400": _error("Invalid request"),
                "401": _error("Missing or wrong API key"),
                "404": _error("Unknown model"),
                "413": _error("Request body too large"),
                "429": _error("Router at capacity; see Retry-After"),
                "502": _error("Every attempt on a worker failed"),
                "503": _error("No healthy worker, or the router is draining"),
                "504": _error("Worker timed out"),
            },
        }
    }


def _get(description: str, *statuses: str) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {"description": description, "content": {"application/json": {}}}
    }
    for status in statuses:
        responses[status] = _error(status)
    return {"get": {"summary": description, "responses": responses}}


def build_openapi(title: str = "radix-router", version: str = "0.1.0") -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    chat = _schema(ChatCompletionRequest, components)
    completion = _schema(CompletionRequest, components)
    generate = _schema(GenerateRequest, components)
    admin_add = {
        "type": "object",
        "required": ["url"],
        "properties": {"url": {"type": "string"}, "worker_id": {"type": "string"}},
    }
    workers = _get(
        "Per-worker state: load, breaker, epoch, tree size, predicted vs actual cache", "401"
    )
    workers["post"] = {
        "summary": "Add a worker by URL (admin key)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": admin_add}}},
        "responses": {
            "201": {"description": "Added"},
            **{s: _error(s) for s in ("400", "401", "403", "413")},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": _inference(chat, "OpenAI chat completion, routed by prefix"),
            "/v1/completions": _inference(completion, "OpenAI completion, routed by prefix"),
            "/generate": _inference(generate, "SGLang-style generate, routed by prefix"),
            "/v1/models": _get("Models served by the fleet", "401"),
            "/health": {
                "get": {
                    "summary": "200 with a routable worker, else 503",
                    "responses": {
                        "200": {"description": "Ready"},
                        "503": {"description": "No routable worker, or draining"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "Metrics", "content": {"text/plain": {}}}},
                }
            },
            "/workers": workers,
            "/workers/{worker_id}": {
                "delete": {
                    "summary": "Remove a worker (admin key)",
                    "parameters": [
                        {
                            "name": "worker_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "Removed"},
                        **{s: _error(s) for s in ("401", "403", "404")},
                    },
                }
            },
        },
        "components": {"schemas": components},
    }
