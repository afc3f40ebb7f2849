"""Create a Kubernetes Secret of random passwords once, and never change it afterwards.

    python -m shared.kube_secret NAME KEY [KEY ...]

The Helm chart runs this as a hook Job (sidecar image, a ServiceAccount that may only
get and create Secrets) to make the built-in Redis's passwords. Helm's `lookup` cannot
do this safely: GitOps tools (Argo CD, Flux) render without a cluster, `lookup` returns
nothing there, and every sync would write a new random password under running pods.
This Job is idempotent instead: it creates the Secret when it is absent and otherwise
leaves it alone (a concurrent run that loses the race gets 409 and is fine too). The
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


def _call(method: str, url: str, token: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    ca = SA_DIR / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca)) if ca.exists() else None
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def ensure_secret(name: str, keys: Sequence[str], namespace: str, labels: dict[str, str]) -> str:
    """ "created" or "exists"; raises RuntimeError on any other answer."""
    token_file = Path(os.environ.get("KUBE_TOKEN_FILE", SA_DIR / "token"))
    token = token_file.read_text().strip()
    base = f"{_api()}/api/v1/namespaces/{namespace}/secrets"
    status = _call("GET", f"{base}/{name}", token)
    if status == 200:
        return "exists"
    if status != 404:
        raise RuntimeError(f"reading Secret {namespace}/{name}: HTTP {status}")
    # URL-safe: the chart puts the passwords into redis:// URLs.
    data = {k: base64.b64encode(secrets.token_urlsafe(24).encode()).decode() for k in keys}
    body = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": data,
    }  # fmt: skip
    status = _call("POST", base, token, body)
    if status == 409:
        return "exists"  # another run created it first
    if status not in (200, 201):
        raise RuntimeError(f"creating Secret {namespace}/{name}: HTTP {status}")
    return "created"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m shared.kube_secret NAME KEY [KEY ...]", file=sys.stderr)
        return 2
    namespace = os.environ.get("POD_NAMESPACE") or (SA_DIR / "namespace").read_text().strip()
    labels = json.loads(os.environ.get("SECRET_LABELS", "{}"))
    try:
        outcome = ensure_secret(args[0], args[1:], namespace, labels)
    except (RuntimeError, OSError) as exc:
        print(f"kube_secret: {exc}", file=sys.stderr)
        return 1
    print(f"Secret {namespace}/{args[0]}: {outcome}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
