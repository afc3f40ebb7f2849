"""What a container sees when the kubelet starts it: its environment and its mounted
config files, computed from rendered manifests the way the kubelet does.

So the tests can run the services' own config loader on exactly what a pod would get,
without a cluster: `value` entries with `$(VAR)` expanded against earlier entries,
`fieldRef` from the downward API, `secretKeyRef` / `configMapKeyRef` from the objects
the chart renders (or from Secrets the user creates beforehand, passed in).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helm.chart import Rendered, pod_spec

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class FakePod:
    """The downward-API facts of one pod."""

    name: str = "rr-radix-router-worker-qwen-0"
    namespace: str = "radix"
    ip: str = "10.1.2.3"
    # Secrets that exist before install (values naming an existingSecret): name -> key -> value.
    external_secrets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, `$$` is a literal `$`,
    undefined references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)


def _field(path: str, pod: FakePod) -> str:
    values = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
    }
    if path not in values:
        raise KeyError(f"fieldRef {path} not simulated")
    return values[path]


def _secret(rendered: Rendered, pod: FakePod, name: str, key: str) -> str | None:
    value = rendered.secret_value(name, key)
    if value is None:
        value = pod.external_secrets.get(name, {}).get(key)
    return value


def _config_map(rendered: Rendered, name: str, key: str) -> str | None:
    cm = rendered.find("ConfigMap", name)
    return None if cm is None else cm.get("data", {}).get(key)


def container_env(rendered: Rendered, container: Mapping[str, Any], pod: FakePod) -> dict[str, str]:
    """The container's environment; raises when a required reference cannot be resolved
    (the pod would fail with CreateContainerConfigError)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field(source["fieldRef"]["fieldPath"], pod)
            continue
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = _secret(rendered, pod, ref["name"], ref["key"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = _config_map(rendered, ref["name"], ref["key"])
        else:
            raise KeyError(f"env {name}: valueFrom {sorted(source)} not simulated")
        if value is None:
            if ref.get("optional"):
                continue
            raise LookupError(f"env {name}: {ref['name']}/{ref['key']} does not exist")
        env[name] = value
    return env


def mount_config_files(
    rendered: Rendered, workload: Mapping[str, Any], container: Mapping[str, Any], root: Path
) -> Path:
    """Write every ConfigMap volume the container mounts under `root` (mirroring the
    mount paths) and return `root`: a path P in the container is `root / P`."""
    volumes = {v["name"]: v for v in pod_spec(dict(workload)).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # absent: a volumeClaimTemplate
        if "configMap" not in volume:
            continue
        data = rendered.get("ConfigMap", volume["configMap"]["name"]).get("data", {})
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for key, text in data.items():
            (target / key).write_text(text)
    return root


def config_flag(container: Mapping[str, Any]) -> str:
    """The path the container passes as `--config`."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if "--config" not in argv:
        raise AssertionError(f"container {container['name']} runs {argv} without --config")
    return argv[argv.index("--config") + 1]


def run_init_container(
    workload: Mapping[str, Any], name: str, pod: FakePod, root: Path
) -> subprocess.CompletedProcess[str]:
    """Run a `sh -c` init container's own script here, as the kubelet would start it: its
    Secret volumes (from `pod.external_secrets`, the Secrets the hook Job makes) and
    emptyDirs appear under `root` (a path P in the pod is `root / P`)."""
    spec = pod_spec(dict(workload))
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == name]
    assert init["command"] == ["sh", "-c"], init["command"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    script = init["args"][0]
    for mount in init.get("volumeMounts", []):
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        if "secret" in volumes[mount["name"]]:
            data = pod.external_secrets.get(volumes[mount["name"]]["secret"]["secretName"], {})
            for key, text in data.items():
                (target / key).write_text(text)
        script = script.replace(mount["mountPath"], str(target))
    env = {"PATH": os.environ["PATH"]}
    for item in init.get("env", []):
        env[item["name"]] = item.get("value") or _field(
            item["valueFrom"]["fieldRef"]["fieldPath"], pod
        )
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
