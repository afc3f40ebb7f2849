"""Operating the chart: stock engines with the attach sidecar, Hub downloads, rollouts
without dropped requests, PDBs, autoscaling, the scrape through the NetworkPolicy, and
the extension points. Commands the pods run are parsed by the services' own CLI parsers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    EXAMPLES_DIR,
    container,
    load_values,
    merged,
    pod_labels,
    pod_spec,
    render,
    selects,
)
from tests.helm.kube_env import FakePod, container_env
from worker.cli import _parser as worker_parser

PROD = EXAMPLES_DIR / "values-production.yaml"
SECRETS = {
    "radix-redis": {"router-url": "redis://radix-router:a@r:6379/0", "worker-url": "redis://radix-worker:b@r:6379/0"},
    "radix-auth": {"api-keys": "k", "admin-key": "a"},
    "hf-token": {"HF_TOKEN": "hf_x"},
}  # fmt: skip


def _model(**entry: Any) -> dict[str, Any]:
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", **entry}]}}


def _sts(rendered: Any, name: str) -> dict[str, Any]:
    return rendered.get("StatefulSet", f"rr-radix-router-worker-{name}")


def _validate(rendered: Any) -> None:
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] in {"ServiceMonitor", "PrometheusRule", "ScaledObject"}


def test_vllm_entry_runs_the_stock_image_with_prefix_caching_and_the_sidecar() -> None:
    rendered = render(load_values(PROD))
    sts = _sts(rendered, "llama70b")
    engine, attach = pod_spec(sts)["containers"]
    assert engine["image"] == "docker.io/vllm/vllm-openai:v0.10.1.1"
    assert engine["command"] == ["vllm", "serve"]
    args = engine["args"]
    assert args[0] == "/models/llama70b"  # the downloaded folder
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--enable-request-id-headers", "--tensor-parallel-size=4", "--served-model-name=llama-3.1-70b", "--port=8001"):  # fmt: skip
        assert flag in args, flag
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert engine["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
    # The sidecar's command line is one the real CLI accepts, and points at the engine.
    assert attach["image"] == "ghcr.io/radix-router/sidecar:0.1.0" and "resources" in attach
    env = container_env(
        rendered,
        attach,
        FakePod(name="rr-radix-router-worker-llama70b-0", external_secrets=SECRETS),
    )
    argv = [a.replace("$(RADIX_WORKER_ADVERTISE_URL)", env["RADIX_WORKER_ADVERTISE_URL"])
             .replace("$(RADIX_WORKER_WORKER_ID)", env["RADIX_WORKER_WORKER_ID"]) for a in attach["args"]]  # fmt: skip
    parsed = worker_parser().parse_args(argv)
    assert parsed.command == "attach" and parsed.engine == "vllm"
    assert (
        parsed.upstream == "http://127.0.0.1:8001"
        and parsed.worker_id == "rr-radix-router-worker-llama70b-0"
    )
    assert parsed.advertise_url.startswith("http://rr-radix-router-worker-llama70b-0.")
    assert env["RADIX_WORKER_REDIS_URL"] == SECRETS["radix-redis"]["worker-url"]  # read by attach
    assert not rendered.find("ConfigMap", "rr-radix-router-worker-llama70b")  # no worker.yaml


def test_sglang_entry_enables_its_metrics() -> None:
    rendered = render(_model(engine="sglang", model={"path": "/models/q"}, gpu={"count": 2}))
    _validate(rendered)
    engine = pod_spec(_sts(rendered, "m"))["containers"][0]
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    assert {"--model-path=/models/q", "--enable-metrics", "--tp-size=2"} <= set(engine["args"])


def test_download_init_container_fills_the_volume_the_engine_reads() -> None:
    rendered = render(load_values(PROD))
    for name, engine_container in (("llama70b", "engine"), ("qwen7b", "worker")):
        sts = _sts(rendered, name)
        (init,) = pod_spec(sts)["initContainers"]
        parsed = worker_parser().parse_args(init["args"])
        assert parsed.command == "download" and parsed.revision == "main"
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert "readOnly" not in mounts["models"] and parsed.dir.startswith(
            mounts["models"]["mountPath"]
        )
        served = {m["name"]: m for m in container(sts, engine_container)["volumeMounts"]}
        assert served["models"]["readOnly"] is True
        assert served["models"]["mountPath"] == mounts["models"]["mountPath"]
    llama_init = pod_spec(_sts(rendered, "llama70b"))["initContainers"][0]
    env = container_env(rendered, llama_init, FakePod(external_secrets=SECRETS))
    assert env["HF_TOKEN"] == "hf_x"
    qwen_yaml = rendered.get("ConfigMap", "rr-radix-router-worker-qwen7b")["data"]["worker.yaml"]
    assert yaml.safe_load(qwen_yaml)["model"] == "/models/qwen7b"


def test_a_radix_entry_asking_for_tensor_parallelism_is_refused() -> None:
    with pytest.raises(helm.HelmError, match="one GPU per pod"):
        render(_model(model={"path": "/m"}, gpu={"count": 2}))


def test_rollouts_drain_within_the_grace_period() -> None:
    rendered = render(load_values(PROD))
    router = rendered.get("Deployment", "rr-radix-router-router")
    c = container(router, "router")
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    config = yaml.safe_load(
        rendered.get("ConfigMap", "rr-radix-router-router")["data"]["router.yaml"]
    )
    assert pod_spec(router)["terminationGracePeriodSeconds"] >= sleep + config["drain_timeout"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    qwen = yaml.safe_load(
        rendered.get("ConfigMap", "rr-radix-router-worker-qwen7b")["data"]["worker.yaml"]
    )
    assert qwen["shutdown_delay"] > 0  # deregister, keep serving, then drain
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render(merged(None, **{"routerSpec.terminationGracePeriodSeconds": 10}))


def test_worker_pdbs_and_keda_target_their_model() -> None:
    rendered = render(load_values(PROD))
    for name in ("llama70b", "qwen7b"):
        pdb = rendered.get("PodDisruptionBudget", f"rr-radix-router-worker-{name}")
        sts = _sts(rendered, name)
        assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(sts))
        others = [s for s in rendered.of_kind("StatefulSet") if s is not sts]
        assert not any(
            selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(o)) for o in others
        )
    so = rendered.get("ScaledObject", "rr-radix-router-worker-qwen7b")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "rr-radix-router-worker-qwen7b",
    }
    assert "radix_router_worker_waiting_requests" in so["spec"]["triggers"][0]["metadata"]["query"]
    assert "replicas" not in _sts(rendered, "qwen7b")["spec"], "KEDA owns the replica count"
    assert not rendered.find("ScaledObject", "rr-radix-router-worker-llama70b")


def test_router_hpa_scales_on_in_flight_requests() -> None:
    hpa = render(load_values(PROD)).get("HorizontalPodAutoscaler", "rr-radix-router-router")
    (metric,) = hpa["spec"]["metrics"]
    assert (
        metric["type"] == "Pods"
        and metric["pods"]["metric"]["name"] == "radix_router_in_flight_requests"
    )


def test_production_network_policy_lets_prometheus_scrape() -> None:
    rendered = render(load_values(PROD))
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    for name in ("rr-radix-router-router", "rr-radix-router-worker"):
        (rule,) = rendered.get("NetworkPolicy", name)["spec"]["ingress"]
        assert monitoring in rule["from"], name
    sm = {s["metadata"]["name"] for s in rendered.of_kind("ServiceMonitor")}
    assert sm == {"rr-radix-router-router", "rr-radix-router-worker"}


EXTRAS = {
    "extraEnv": [{"name": "EXTRA", "value": "1"}],
    "extraVolumes": [{"name": "extra", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
    "nodeSelector": {"pool": "x"},
    "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}}},
    "priorityClassName": "high",
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}],
    "runtimeClassName": "nvidia",
}  # fmt: skip


@pytest.mark.parametrize("engine", ["radix", "vllm"])
def test_extension_points_reach_router_and_worker_pods(engine: str) -> None:
    values = merged(None, **{f"routerSpec.{k}": v for k, v in EXTRAS.items()})
    values["servingEngineSpec"] = {
        "modelSpec": [{"name": "m", "engine": engine, "model": {"path": "/models/m"}, **EXTRAS}]
    }
    helm.Chart.load(Path(__file__).resolve().parents[2] / "helm" / "radix-router").validate_schema(
        values
    )
    rendered = render(values)
    _validate(rendered)
    for workload in (rendered.get("Deployment", "rr-radix-router-router"), _sts(rendered, "m")):
        spec = pod_spec(workload)
        main = spec["containers"][0]
        for key in (
            "nodeSelector",
            "tolerations",
            "affinity",
            "priorityClassName",
            "topologySpreadConstraints",
            "runtimeClassName",
        ):
            assert spec[key] == EXTRAS[key], (workload["metadata"]["name"], key)  # fmt: skip
        assert {"name": "extra", "emptyDir": {}} in spec["volumes"]
        assert {"name": "extra", "mountPath": "/extra"} in main["volumeMounts"]
        assert {"name": "EXTRA", "value": "1"} in main["env"]
