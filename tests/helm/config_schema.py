"""The `config` parts of values.schema.json, derived from the services' own config models.

`routerSpec.config` and `servingEngineSpec.modelSpec[].config` are rendered verbatim into
router.yaml / worker.yaml, so their schema must be exactly the keys of `RouterConfig` /
`WorkerConfig` (shared/config.py) minus the keys the chart sets itself or passes through
the environment. test_schema.py fails when the two drift; rewrite the chart's schema with

    python -m tests.helm.config_schema --write
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shared.config import RouterConfig, WorkerConfig

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "helm" / "radix-router" / "values.schema.json"

# Keys the chart renders itself (from other values) or sends through the environment
# (per-pod values and secrets): a user setting them under `config` would be overridden
# or would put a secret into a ConfigMap, so the schema rejects them.
ROUTER_CHART_KEYS = frozenset(
    {"host", "port", "redis_prefix", "sync", "redis_url", "api_keys", "admin_key", "worker_api_key"}
)
WORKER_CHART_KEYS = frozenset(
    {
        "host",
        "port",
        "engine",
        "model",
        "served_model_name",
        "redis_prefix",
        "redis_url",
        "redis_password_file",
        "worker_id",
        "advertise_url",
        "api_keys",
    }
)

# JSON-schema keywords worth keeping from pydantic's output; titles and defaults are noise.
_KEEP = frozenset(
    {
        "type",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "items",
        "anyOf",
        "const",
    }
)


def _clean(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _clean(v) for k, v in node.items() if k in _KEEP}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def config_schema(model: type[BaseModel], chart_keys: frozenset[str]) -> dict[str, Any]:
    """A closed object schema over the model's fields that users may set."""
    props = model.model_json_schema()["properties"]
    unknown = chart_keys - props.keys()
    if unknown:
        raise KeyError(f"{model.__name__} has no keys {sorted(unknown)}: update the chart")
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {k: _clean(v) for k, v in props.items() if k not in chart_keys},
    }


def expected_schema(current: dict[str, Any]) -> dict[str, Any]:
    """`current` (the chart's schema) with both config parts regenerated."""
    out = json.loads(json.dumps(current))
    out["properties"]["routerSpec"]["properties"]["config"] = config_schema(
        RouterConfig, ROUTER_CHART_KEYS
    )
    out["definitions"]["modelSpec"]["properties"]["config"] = config_schema(
        WorkerConfig, WORKER_CHART_KEYS
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite values.schema.json")
    args = parser.parse_args()
    current = json.loads(SCHEMA_PATH.read_text())
    new = expected_schema(current)
    if args.write:
        SCHEMA_PATH.write_text(json.dumps(new, indent=2) + "\n")
        print(f"wrote {SCHEMA_PATH}")
    else:
        print("up to date" if new == current else "out of date: run with --write")


if __name__ == "__main__":
    main()
