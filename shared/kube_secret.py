"""Create a Kubernetes Secret of random passwords once, and never change it afterwards.

    python -m shared.kube_secret NAME [KEY ...] [-- NAME [KEY ...]] ...

The Helm chart runs this as a hook Job (sidecar image, a ServiceAccount that may only
get, patch and create Secrets) to make the built-in Redis's passwords. Helm's `lookup` cannot
do this safely: GitOps tools (Argo CD, Flux) render without a cluster, `lookup` returns
nothing there, and every sync would write a new random password under running pods.
This Job is idempotent instead: it creates the Secret when it is absent and otherwise
leaves its values alone, only adding keys it lacks (a worker pod's password after a
scale-up; a concurrent run that loses the race gets 409 and looks again). The
Secret is not part of the release, so upgrades and re-syncs never touch it; delete it
by hand to rotate the passwords.

It talks to the API server with the pod's ServiceAccount token over the in-cluster
address (`KUBERNETES_SERVICE_HOST`), standard library only.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def _api() -> str:
    if url := os.environ.get("KUBE_API_URL"):  # tests, or a proxy
        return url.rstrip("/")
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _call(method: str, url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
    req.add_header("Content-Type", kind)
    ca = SA_DIR / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca)) if ca.exists() else None
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _passwords(keys: Sequence[str]) -> dict[str, str]:
    # URL-safe: the chart puts the passwords into redis:// URLs.
    return {k: base64.b64encode(secrets.token_urlsafe(24).encode()).decode() for k in keys}


def ensure_secret(name: str, keys: Sequence[str], namespace: str, labels: dict[str, str]) -> str:
    """ "created", "exists", or "added N keys" (keys the Secret lacked, e.g. the password of
    a worker pod added by scaling up; the keys it has are never changed). RuntimeError on
    any other answer."""
    token_file = Path(os.environ.get("KUBE_TOKEN_FILE", SA_DIR / "token"))
    token = token_file.read_text().strip()
    base = f"{_api()}/api/v1/namespaces/{namespace}/secrets"
    for _ in range(5):  # a 409 means another run wrote first: look again
        status, current = _call("GET", f"{base}/{name}", token)
        if status == 200:
            missing = [k for k in keys if k not in (current.get("data") or {})]
            if not missing:
                return "exists"
            # resourceVersion makes the patch conditional: two runs never both add a key.
            version = (current.get("metadata") or {}).get("resourceVersion")
            patch = {"metadata": {"resourceVersion": version}, "data": _passwords(missing)}
            status, _ = _call("PATCH", f"{base}/{name}", token, patch)
            if status == 200:
                return f"added {len(missing)} keys"
            if status != 409:
                raise RuntimeError(f"adding keys to Secret {namespace}/{name}: HTTP {status}")
            continue
        if status != 404:
            raise RuntimeError(f"reading Secret {namespace}/{name}: HTTP {status}")
        body = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "data": _passwords(keys),
        }  # fmt: skip
        status, _ = _call("POST", base, token, body)
        if status in (200, 201):
            return "created"
        if status != 409:
            raise RuntimeError(f"creating Secret {namespace}/{name}: HTTP {status}")
    raise RuntimeError(f"Secret {namespace}/{name}: kept changing under this run")


USAGE = "usage: python -m shared.kube_secret NAME [KEY ...] [-- NAME [KEY ...]] ..."


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    groups: list[list[str]] = [[]]
    for arg in args:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    if any(not group for group in groups):  # a NAME alone: an empty Secret (no workers yet)
        print(USAGE, file=sys.stderr)
        return 2
    namespace = os.environ.get("POD_NAMESPACE") or (SA_DIR / "namespace").read_text().strip()
    labels = json.loads(os.environ.get("SECRET_LABELS", "{}"))
    for name, *keys in groups:
        try:
            outcome = ensure_secret(name, keys, namespace, labels)
        except (RuntimeError, OSError) as exc:
            print(f"kube_secret: {exc}", file=sys.stderr)
            return 1
        print(f"Secret {namespace}/{name}: {outcome}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
