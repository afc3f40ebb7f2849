"""The router's OpenAPI document, generated from shared/wire/protocol's pydantic models.

Schemathesis fuzzes the router against this document, so every status an endpoint
can answer is listed, with the OpenAI error shape for the 4xx/5xx ones.
"""

from __future__ import annotations

from typing import Any

from shared.serving.openapi import ERROR_SCHEMA, add_schema, error_spec, inference_operation
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateWireRequest

# Every status a routed inference request can be answered with.
_INFERENCE_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "Request body not received within body_read_timeout",
    "413": "Request body too large",
    "415": "Content-Encoding other than gzip or deflate",
    "429": "Past the API key's rate limit or its tenant's queue bound; see Retry-After",
    "500": "The request failed on two workers (its fault, not the fleet's)",
    "502": "Every attempt on a worker failed",
    "503": "No healthy worker, every worker tried refused it as busy (see Retry-After), or draining",
    "504": "Worker timed out",
}


def _routed_inference(ref: dict[str, Any], summary: str) -> dict[str, Any]:
    ok = "The worker's answer (JSON, or SSE when stream is true)"
    return inference_operation(ref, summary, ok, _INFERENCE_ERRORS)


def _get_path(description: str, *statuses: str) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {"description": description, "content": {"application/json": {}}}
    }
    for status in statuses:
        responses[status] = error_spec(status)
    return {"get": {"summary": description, "responses": responses}}


def build_openapi(title: str = "radix-router", version: str = "0.1.0") -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    chat = add_schema(ChatCompletionRequest, components)
    completion = add_schema(CompletionRequest, components)
    generate = add_schema(GenerateWireRequest, components)
    admin_add = {
        "type": "object",
        "required": ["url"],
        "properties": {"url": {"type": "string"}, "worker_id": {"type": "string"}},
    }
    workers = _get_path(
        "Per-worker state: load, breaker, epoch, tree size, predicted vs actual cache", "401"
    )
    workers["post"] = {
        "summary": "Add a worker by URL (admin key)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": admin_add}}},
        "responses": {
            "201": {"description": "Added"},
            **{s: error_spec(s) for s in ("400", "401", "403", "413")},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": _routed_inference(
                chat, "OpenAI chat completion, routed by prefix"
            ),
            "/v1/completions": _routed_inference(completion, "OpenAI completion, routed by prefix"),
            "/generate": _routed_inference(generate, "SGLang-style generate, routed by prefix"),
            "/v1/models": _get_path("Models served by the fleet", "401"),
            "/health": {
                "get": {
                    "summary": "200 with a routable worker, else 503",
                    "responses": {
                        "200": {"description": "Ready"},
                        "503": {"description": "No routable worker, or draining"},
                    },
                }
            },
            "/liveness": {
                "get": {
                    "summary": "200 while the process runs (no workers needed)",
                    "responses": {"200": {"description": "Alive"}},
                }
            },
            "/readiness": {
                "get": {
                    "summary": "200 with a routable worker, else 503 with the reason",
                    "responses": {
                        "200": {"description": "Ready"},
                        "503": {"description": "No routable worker, or shutting down"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "Metrics", "content": {"text/plain": {}}}},
                }
            },
            "/dashboard": {
                "get": {
                    "summary": "Live fleet page (HTML; behind the key with protect_metrics)",
                    "responses": {
                        "200": {"description": "The page", "content": {"text/html": {}}},
                        "401": error_spec("401"),
                    },
                }
            },
            "/dashboard.json": _get_path(
                "The dashboard's data: workers, fleet hit rate, route reasons", "401"
            ),
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
                        **{s: error_spec(s) for s in ("401", "403", "404")},
                    },
                }
            },
        },
        "components": {"schemas": components},
    }
