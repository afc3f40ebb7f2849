"""Render the Helm chart offline (helm-python-sdk: Helm's own Go code, no binary, no
cluster) and look objects up in the result."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "radix-router"
EXAMPLES_DIR = ROOT / "helm" / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("values-*.yaml"))
RELEASE = "rr"
NAMESPACE = "radix"

Manifest = dict[str, Any]


def load_values(path: Path | None) -> dict[str, Any] | None:
    """The values of one example file; None means the chart's defaults."""
    return None if path is None else yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class Rendered:
    """Every object one `helm template` produces, with the NOTES text."""

    objects: tuple[Manifest, ...]
    notes: str

    def of_kind(self, kind: str) -> list[Manifest]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Manifest:
        for o in self.of_kind(kind):
            if o["metadata"]["name"] == name:
                return o
        names = [o["metadata"]["name"] for o in self.of_kind(kind)]
        raise KeyError(f"no {kind} named {name!r}; have {names}")

    def find(self, kind: str, name: str) -> Manifest | None:
        try:
            return self.get(kind, name)
        except KeyError:
            return None

    def component(self, kind: str, component: str) -> list[Manifest]:
        """Objects of `kind` labelled app.kubernetes.io/component=`component`."""
        return [
            o
            for o in self.of_kind(kind)
            if labels(o).get("app.kubernetes.io/component") == component
        ]

    def workloads(self) -> Iterator[Manifest]:
        for kind in ("Deployment", "StatefulSet"):
            yield from self.of_kind(kind)

    def secret_value(self, name: str, key: str) -> str | None:
        """A key of a Secret the chart renders, decoded; None when the chart makes no such Secret."""
        secret = self.find("Secret", name)
        if secret is None:
            return None
        if key in secret.get("stringData", {}):
            return str(secret["stringData"][key])
        raw = secret.get("data", {}).get(key)
        return None if raw is None else base64.b64decode(raw).decode()


def render(values: Mapping[str, Any] | None = None) -> Rendered:
    chart = helm.Chart.load(CHART_DIR)
    out = chart.render(dict(values) if values else None, name=RELEASE, namespace=NAMESPACE)
    objects: list[Manifest] = []
    notes = ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(tuple(objects), notes)


def labels(obj: Manifest) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def pod_spec(workload: Manifest) -> dict[str, Any]:
    return (
        workload["spec"]["template"]["spec"] if "template" in workload["spec"] else workload["spec"]
    )


def pod_labels(workload: Manifest) -> dict[str, str]:
    if workload["kind"] == "Pod":
        return labels(workload)
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: Manifest, name: str) -> dict[str, Any]:
    for c in pod_spec(workload)["containers"]:
        if c["name"] == name:
            return c
    raise KeyError(f"{workload['metadata']['name']} has no container {name!r}")


def selects(selector: Mapping[str, str], pod: Mapping[str, str]) -> bool:
    """A label selector (matchLabels) matches a pod's labels."""
    return bool(selector) and all(pod.get(k) == v for k, v in selector.items())


def merged(base: Mapping[str, Any] | None, **changes: Any) -> dict[str, Any]:
    """`base` with dotted keys replaced, e.g. merged(v, **{"routerSpec.replicaCount": 3})."""
    out: dict[str, Any] = yaml.safe_load(yaml.safe_dump(dict(base or {})))
    for dotted, value in changes.items():
        node = out
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out
