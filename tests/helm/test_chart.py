"""The Helm chart lints, renders valid Kubernetes objects, and is wired together:
selectors match pods, probes hit real ports, GPUs are requested, traffic is allowed
exactly along clients → router → workers and both → Redis."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    CHART_DIR,
    EXAMPLES,
    EXAMPLES_DIR,
    Rendered,
    container,
    labels,
    load_values,
    merged,
    pod_labels,
    pod_spec,
    render,
    selects,
)

CASES = [None, *EXAMPLES]
IDS = ["defaults", *(p.stem for p in EXAMPLES)]
KUBE_VERSIONS = ["1.30.0", "1.33.0"]
# Custom resources kubernetes-validate has no schema for; checked field by field below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
PROBE_PATHS = {"/health", "/liveness", "/readiness"}


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any] | None, Rendered]:
    values = load_values(request.param)
    return values, render(values)


def test_examples_exist() -> None:
    assert {p.stem for p in EXAMPLES} >= {"values-minimal", "values-production", "values-cpu-sim"}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_helm_lint_strict(path: Path | None, kube: str) -> None:
    report = helm.lint(CHART_DIR, load_values(path), strict=True, kube_version=f"v{kube}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_manifests_pass_kubernetes_validate_strict(case: tuple[Any, Rendered], kube: str) -> None:
    _, rendered = case
    for obj in rendered.objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] in CRD_KINDS, f"{where}: no schema for Kubernetes {kube}"
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} invalid for Kubernetes {kube}: {e.message} at {list(e.path)}")


def test_validator_rejects_a_broken_manifest() -> None:
    """Control: the strict validator does fail on an unknown field, so the test above can fail."""
    deployment = copy.deepcopy(render().get("Deployment", "rr-radix-router-router"))
    pod_spec(deployment)["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def _port_names(workload: dict[str, Any]) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in pod_spec(workload)["containers"]
        for p in c.get("ports", [])
    }


def serving_container(sts: dict[str, Any]) -> dict[str, Any]:
    """Our worker, or a stock engine's server (the container with the GPUs and the port)."""
    return pod_spec(sts)["containers"][0]


def test_services_select_pods_and_ports(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    for svc in rendered.of_kind("Service"):
        selector = svc["spec"]["selector"]
        targets = [w for w in rendered.workloads() if selects(selector, pod_labels(w))]
        assert targets, f"Service {svc['metadata']['name']} selects no pods"
        for w in targets:
            ports = _port_names(w)
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in ports, (
                    f"{svc['metadata']['name']} → {w['metadata']['name']}"
                )
    # A worker Service fronts exactly its own model's StatefulSet.
    for sts in rendered.of_kind("StatefulSet"):
        svc = rendered.get("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        selected = [
            w["metadata"]["name"]
            for w in rendered.workloads()
            if selects(svc["spec"]["selector"], pod_labels(w))
        ]
        assert selected == [sts["metadata"]["name"]]


def test_workload_selectors_match_their_pods(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    for w in rendered.workloads():
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), w["metadata"]["name"]


def test_probe_ports_are_container_ports(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    for w in rendered.workloads():
        for c in pod_spec(w)["containers"]:
            if "ports" not in c:  # the attach sidecar serves nothing
                assert c["name"] == "attach", c["name"]
                continue
            ports = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
            probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
            assert probes, f"{c['name']} has no probes"
            for probe in probes:
                action = probe.get("httpGet") or probe.get("tcpSocket")
                if action is None:
                    assert "exec" in probe
                    continue
                assert action["port"] in ports, f"{w['metadata']['name']}/{c['name']}: {action}"
                if "httpGet" in probe:
                    # Paths the services serve (the router's are tested against a real
                    # process in tests/e2e/test_probes_and_ratelimit.py).
                    assert probe["httpGet"]["path"] in PROBE_PATHS, probe


def test_router_and_workers_have_startup_probes(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    for w in [*rendered.component("Deployment", "router"), *rendered.of_kind("StatefulSet")]:
        c = pod_spec(w)["containers"][0]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= c.keys()
    for sts in rendered.of_kind("StatefulSet"):
        probe = serving_container(sts)["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget >= 60, "a worker needs time to load its model before liveness applies"


def _gpu_keys(resources: dict[str, Any]) -> set[str]:
    return {k for part in resources.values() for k in part if "gpu" in k}


def test_gpu_requests_on_workers(case: tuple[Any, Rendered]) -> None:
    values, rendered = case
    is_sim = values is not None and all(
        m["engine"] == "sim" for m in values["servingEngineSpec"]["modelSpec"]
    )
    for sts in rendered.of_kind("StatefulSet"):
        resources = serving_container(sts)["resources"]
        if is_sim:
            assert not _gpu_keys(resources), "the CPU sim fleet must not ask for GPUs"
        else:
            assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    for w in rendered.of_kind("Deployment"):
        assert not _gpu_keys(pod_spec(w)["containers"][0].get("resources", {})), w["metadata"][
            "name"
        ]


def test_gpu_resource_name_and_count_are_configurable() -> None:
    values = merged(None)
    values["servingEngineSpec"] = {
        "modelSpec": [
            {
                "name": "a",
                "engine": "vllm",
                "model": {"path": "/models/a"},
                "gpu": {"count": 2, "resourceName": "amd.com/gpu"},
            },
            {"name": "b", "model": {"path": "/models/b"}, "gpu": {"count": 0}},
        ]
    }
    rendered = render(values)
    a = container(rendered.get("StatefulSet", "rr-radix-router-worker-a"), "engine")["resources"]
    b = container(rendered.get("StatefulSet", "rr-radix-router-worker-b"), "worker")["resources"]
    assert a["limits"]["amd.com/gpu"] == 2 and "nvidia.com/gpu" not in a["limits"]
    assert not _gpu_keys(b)


def _ingress_peers(policy: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The `from` peers of a one-rule policy; None means any source."""
    (rule,) = policy["spec"]["ingress"]
    return rule.get("from")


def _allows_pods(peers: list[dict[str, Any]] | None, pod: dict[str, str]) -> bool:
    if peers is None:
        return True
    return any(
        set(p) == {"podSelector"} and selects(p["podSelector"]["matchLabels"], pod) for p in peers
    )


def _policy_for(rendered: Rendered, pod: dict[str, str]) -> dict[str, Any]:
    (policy,) = [
        p
        for p in rendered.of_kind("NetworkPolicy")
        if selects(p["spec"]["podSelector"]["matchLabels"], pod)
    ]
    return policy


def test_network_policies_follow_the_traffic(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    router = pod_labels(rendered.get("Deployment", "rr-radix-router-router"))
    test_pod = labels(rendered.of_kind("Pod")[0])
    workers = [pod_labels(s) for s in rendered.of_kind("StatefulSet")]
    # clients → router (any source, or the listed ones plus the helm test pod)
    router_policy = _policy_for(rendered, router)
    assert _allows_pods(_ingress_peers(router_policy), test_pod)
    # router → workers, and no other pod of the release
    for worker in workers:
        peers = _ingress_peers(_policy_for(rendered, worker))
        assert _allows_pods(peers, router)
        assert not _allows_pods(peers, test_pod)
    # router and workers → the built-in Redis, nothing else
    redis = rendered.component("Deployment", "redis")
    if redis:
        peers = _ingress_peers(_policy_for(rendered, pod_labels(redis[0])))
        assert _allows_pods(peers, router) and all(_allows_pods(peers, w) for w in workers)
        assert not _allows_pods(peers, test_pod)


def test_one_statefulset_per_model(case: tuple[Any, Rendered]) -> None:
    values, rendered = case
    models = (values or {}).get("servingEngineSpec", {}).get("modelSpec") or [{"name": "qwen"}]
    names = sorted(s["metadata"]["name"] for s in rendered.of_kind("StatefulSet"))
    assert names == sorted(f"rr-radix-router-worker-{m['name']}" for m in models)
    for sts in rendered.of_kind("StatefulSet"):
        assert len(sts["metadata"]["name"]) <= 52, (
            "StatefulSet names over 52 chars break pod labels"
        )


def test_pods_are_locked_down(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    # The one Role: the hook Job that creates the built-in Redis's password Secrets once
    # (and adds worker pods' keys): only those two Secrets can be read or patched.
    for role in rendered.of_kind("Role"):
        assert role["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        allowed = {
            (v, tuple(r.get("resourceNames", ()))) for r in role["rules"] for v in r["verbs"]
        }
        named = ("rr-radix-router-redis-auth", "rr-radix-router-redis-workers")
        assert allowed == {("get", named), ("patch", named), ("create", ())}, allowed
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    for w in [*rendered.workloads(), *rendered.of_kind("Pod")]:
        spec = pod_spec(w)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_production_extras_target_the_router() -> None:
    rendered = render(load_values(EXAMPLES_DIR / "values-production.yaml"))
    router = rendered.get("Deployment", "rr-radix-router-router")
    assert "replicas" not in router["spec"], "the HPA owns the replica count"
    hpa = rendered.get("HorizontalPodAutoscaler", "rr-radix-router-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rr-radix-router-router",
    }
    pdb = rendered.get("PodDisruptionBudget", "rr-radix-router-router")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(router))
    ingress = rendered.get("Ingress", "rr-radix-router-router")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rr-radix-router-router", "port": {"name": "http"}}
    monitors = rendered.of_kind("ServiceMonitor")
    assert {labels(m)["app.kubernetes.io/component"] for m in monitors} == {"router", "worker"}
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        services = [
            s
            for s in rendered.of_kind("Service")
            if selects(m["spec"]["selector"]["matchLabels"], labels(s))
        ]
        assert services, f"ServiceMonitor {m['metadata']['name']} selects no Service"
        (endpoint,) = m["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)


def test_mounts_resolve_and_images_are_complete(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    for w in [*rendered.workloads(), *rendered.of_kind("Pod")]:
        spec = pod_spec(w)
        volumes = {v["name"] for v in spec.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{w['metadata']['name']}/{c['name']}"
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, where
            assert ":" in c["image"] and not c["image"].endswith(":"), where
            assert c.get("imagePullPolicy", "IfNotPresent") in {
                "Always",
                "IfNotPresent",
                "Never",
            }, where


def test_helm_test_pod_calls_the_router(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    (pod,) = rendered.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    svc = rendered.get("Service", "rr-radix-router-router")
    url = f"http://rr-radix-router-router:{svc['spec']['ports'][0]['port']}"
    assert f"{url}/health" in script and f"{url}/v1/completions" in script
    # It asks for the model the first worker serves.
    sts = rendered.of_kind("StatefulSet")[0]
    args = serving_container(sts).get("args", [])
    flag = next((a for a in args if a.startswith("--served-model-name=")), None)
    if flag is not None:  # a stock engine
        name = flag.split("=", 1)[1]
    else:
        worker_yaml = rendered.get("ConfigMap", sts["metadata"]["name"])["data"]["worker.yaml"]
        name = yaml.safe_load(worker_yaml)["served_model_name"]
    assert f'"model": "{name}"' in script


def test_notes_say_how_to_reach_the_router(case: tuple[Any, Rendered]) -> None:
    _, rendered = case
    assert "rr-radix-router-router" in rendered.notes or "ROUTER_URL=https://" in rendered.notes
    assert "$ROUTER_URL/v1/chat/completions" in rendered.notes
    assert "helm test rr" in rendered.notes
