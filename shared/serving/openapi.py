"""OpenAPI 3.1 building blocks both services' documents are made of.

The request schemas come from shared/wire/protocol's pydantic models (the ones the handlers
validate with), and every error answer points at one `Error` schema: the OpenAI error
shape `shared/serving/errors.error_body` always writes, all four fields present.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
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


def error_spec(description: str) -> dict[str, Any]:
    """A 4xx/5xx answer whose body is the OpenAI error shape."""
    ref = {"$ref": REF.format(model="Error")}
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def add_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """Put `model`'s JSON schema (and the models it nests) into `components`; its $ref."""
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def inference_operation(
    ref: dict[str, Any], summary: str, ok: str, errors: dict[str, str]
) -> dict[str, Any]:
    """A POST taking the JSON body `ref`, answering JSON, or SSE when `stream` is true."""
    answer = {
        "description": ok,
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    }
    responses = {"200": answer, **{s: error_spec(d) for s, d in errors.items()}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": responses,
        }
    }
