"""values.schema.json rejects bad values at install time, stays in step with the services'
config models, and the options it admits (model storage, Redis) render as documented."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm.chart import (
    CHART_DIR,
    EXAMPLES,
    container,
    load_values,
    merged,
    pod_spec,
    render,
)
from tests.helm.config_schema import SCHEMA_PATH, expected_schema

GOOD_MODEL = {"name": "m", "model": {"path": "/models/m"}}


def _with_model(**model: Any) -> dict[str, Any]:
    return {"servingEngineSpec": {"modelSpec": [{**GOOD_MODEL, **model}]}}


@pytest.mark.parametrize(
    ("values", "mentions"),
    [
        (merged(None, **{"routerSpec.replicaCount": -1}), "replicaCount"),
        (merged(None, **{"routerSpec.config.policy": "fastest"}), "policy"),
        (merged(None, **{"routerSpec.config.cache_threshold": 1.5}), "cache_threshold"),
        (merged(None, **{"routerSpec.config.no_such_key": 1}), "no_such_key"),
        # Secrets and chart-owned keys may not be put into the ConfigMap.
        (merged(None, **{"routerSpec.config.redis_url": "redis://x:6379"}), "redis_url"),
        (merged(None, **{"routerSpec.config.admin_key": "a"}), "admin_key"),
        (merged(None, **{"routerSpec.sync": "sometimes"}), "sync"),
        (merged(None, **{"routerSpec.service.type": "External"}), "type"),
        (_with_model(engine="tgi"), "engine"),
        (_with_model(replicaCount=-2), "replicaCount"),
        (_with_model(name="Bad_Name"), "name"),
        (_with_model(gpu={"count": -1}), "count"),
        (_with_model(config={"max_running_requests": 0}), "max_running_requests"),
        (_with_model(config={"worker_id": "fixed"}), "worker_id"),
        (_with_model(config={"host_cache_tokens": -1}), "host_cache_tokens"),
        (_with_model(config={"host_cache_tokens": 1.5}), "host_cache_tokens"),
        (_with_model(config={"host_write_policy": "never"}), "host_write_policy"),
        (_with_model(model={"path": "/m", "storage": {"type": "s3"}}), "type"),
        (merged(None, **{"redis.builtin.auth.routerPasswordKey": "a b"}), "routerPasswordKey"),
        (merged(None, **{"redis.external.url": "http://redis:6379"}), "url"),
        (merged(None, **{"surprise": True}), "surprise"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_schema_rejects_bad_values(values: dict[str, Any], mentions: str) -> None:
    chart = helm.Chart.load(CHART_DIR)
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert mentions in str(err.value)
    # An install renders through the same check.
    with pytest.raises(helm.HelmError):
        render(values)


@pytest.mark.parametrize("path", [None, *EXAMPLES], ids=["defaults", *(p.stem for p in EXAMPLES)])
def test_schema_accepts_defaults_and_examples(path: Any) -> None:
    helm.Chart.load(CHART_DIR).validate_schema(load_values(path))


def test_config_schema_matches_the_config_models() -> None:
    """routerSpec.config / modelSpec[].config admit exactly the services' config keys
    (less the chart-owned ones). Fix a failure with `python -m tests.helm.config_schema --write`."""
    current = json.loads(SCHEMA_PATH.read_text())
    assert current == expected_schema(current)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (merged(None, **{"redis.builtin.enabled": False}), "redis.external.url"),
        (merged(None, **{"redis.external.url": "redis://r:6379/0"}), "builtin.enabled"),
        (_with_model(model={"path": ""}), "needs model.path or model.huggingface.repo"),
        (
            {"servingEngineSpec": {"modelSpec": [GOOD_MODEL, GOOD_MODEL]}},
            "used twice",
        ),
        (
            _with_model(model={"path": "/m", "storage": {"type": "existingClaim"}}),
            "existingClaim is required",
        ),
    ],
    ids=["no-redis", "two-redis", "no-model-path", "duplicate-name", "claim-missing"],
)
def test_cross_field_mistakes_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def _models_volume(values: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    rendered = render(values)
    for obj in rendered.objects:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    sts = rendered.get("StatefulSet", "rr-radix-router-worker-m")
    volumes = {v["name"]: v for v in pod_spec(sts).get("volumes", [])}
    return volumes.get("models"), sts


@pytest.mark.parametrize(
    ("storage", "expect"),
    [
        (
            {"type": "existingClaim", "existingClaim": "weights"},
            {"persistentVolumeClaim": {"claimName": "weights"}},
        ),
        (
            {"type": "newPvc"},
            {"persistentVolumeClaim": {"claimName": "rr-radix-router-worker-m-models"}},
        ),
        (
            {"type": "hostPath", "hostPath": "/mnt/models"},
            {"hostPath": {"path": "/mnt/models", "type": "Directory"}},
        ),
        ({"type": "emptyDir"}, {"emptyDir": {}}),
        ({"type": "perPodPvc"}, None),
        ({"type": "none"}, None),
    ],
    ids=lambda v: v.get("type", "") if isinstance(v, dict) else "",
)
def test_model_storage_kinds(storage: dict[str, Any], expect: dict[str, Any] | None) -> None:
    volume, sts = _models_volume(_with_model(model={"path": "/models/m", "storage": storage}))
    if expect is None:
        assert volume is None
    else:
        assert volume == {"name": "models", **expect}
    templates = sts["spec"].get("volumeClaimTemplates", [])
    assert bool(templates) == (storage["type"] == "perPodPvc")
    mounted = any(m["name"] == "models" for m in container(sts, "worker")["volumeMounts"])
    assert mounted == (storage["type"] != "none")


def test_new_pvc_is_kept_on_uninstall() -> None:
    rendered = render(
        _with_model(model={"path": "/models/m", "storage": {"type": "newPvc", "size": "10Gi"}})
    )
    pvc = rendered.get("PersistentVolumeClaim", "rr-radix-router-worker-m-models")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_init_container_fills_a_writable_model_volume() -> None:
    init = {
        "enabled": True,
        "image": "busybox:1.36",
        "command": ["sh", "-c", "cp -r /src/. $MODEL_DIR"],
    }
    _, sts = _models_volume(
        _with_model(
            model={"path": "/models/m", "storage": {"type": "emptyDir"}, "initContainer": init}
        )
    )
    (fetch,) = [c for c in pod_spec(sts)["initContainers"] if c["name"] == "fetch-model"]
    assert {"name": "MODEL_DIR", "value": "/models/m"} in fetch["env"]
    assert [m["mountPath"] for m in fetch["volumeMounts"]] == ["/models"]
    # Without an init container the worker only reads the weights.
    _, plain = _models_volume(
        _with_model(
            model={"path": "/models/m", "storage": {"type": "existingClaim", "existingClaim": "w"}}
        )
    )
    (mount,) = [m for m in container(plain, "worker")["volumeMounts"] if m["name"] == "models"]
    assert mount["readOnly"] is True


def test_shm_size_and_entry_overrides_keep_defaults() -> None:
    """An entry overrides only what it names; false/0/"" override too."""
    rendered = render(_with_model(shmSize="", gpu={"count": 0}, config={"cache_tokens": 1000}))
    sts = rendered.get("StatefulSet", "rr-radix-router-worker-m")
    assert all(v["name"] != "dshm" for v in pod_spec(sts).get("volumes", []))
    worker = container(sts, "worker")
    assert not any("gpu" in k for part in worker["resources"].values() for k in part)
    assert worker["startupProbe"]["failureThreshold"] == 180, "defaults fill what the entry omits"
    cm = rendered.get("ConfigMap", "rr-radix-router-worker-m")["data"]["worker.yaml"]
    assert "cache_tokens: 1000" in cm and "max_running_requests: 64" in cm


def test_host_tier_keys_reach_the_worker_config_file() -> None:
    config = {"host_cache_tokens": 1_000_000, "host_write_policy": "write_through"}
    rendered = render(_with_model(config=config))
    cm = rendered.get("ConfigMap", "rr-radix-router-worker-m")["data"]["worker.yaml"]
    assert "host_cache_tokens: 1000000" in cm and "host_write_policy: write_through" in cm


def test_a_config_change_rolls_only_that_models_pods() -> None:
    two = [{**GOOD_MODEL, "name": "a"}, {**GOOD_MODEL, "name": "b"}]
    changed = [{**two[0], "config": {"max_running_requests": 7}}, two[1]]

    def checksums(models: list[dict[str, Any]]) -> dict[str, str]:
        rendered = render({"servingEngineSpec": {"modelSpec": models}})
        pods = {
            w["metadata"]["name"]: w["spec"]["template"]["metadata"] for w in rendered.workloads()
        }
        # The built-in Redis has no config file to follow.
        return {
            name: meta["annotations"]["checksum/config"]
            for name, meta in pods.items()
            if meta["labels"]["app.kubernetes.io/component"] != "redis"
        }

    before, after = checksums(two), checksums(changed)
    assert before["rr-radix-router-worker-a"] != after["rr-radix-router-worker-a"]
    assert before["rr-radix-router-worker-b"] == after["rr-radix-router-worker-b"]
    assert before["rr-radix-router-router"] == after["rr-radix-router-router"]
